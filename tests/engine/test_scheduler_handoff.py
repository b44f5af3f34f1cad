"""Scheduler and KV manager support for the P -> D hand-off: hold, release, reserve, admit."""

from __future__ import annotations

import pytest

from factories import assert_no_leaks, make_request, make_scheduler, run_to_completion, step
from pdserve.engine.request import RequestStatus


def test_hold_kv_keeps_blocks_after_finish_until_released() -> None:
    s = make_scheduler(num_blocks=16, block_size=4)
    req = make_request("p", prompt_len=10, max_tokens=1)
    req.hold_kv = True
    s.add_request(req)
    step(s)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.output_token_ids == [7]
    assert "p" in s.held and s.kv.get_block_ids("p") and not s.has_unfinished()
    with pytest.raises(ValueError, match="in use"):
        s.add_request(make_request("p"))
    assert s.release_held("p") and not s.release_held("p")
    assert_no_leaks(s)


def test_abort_of_a_held_request_frees_it_and_aborts_never_hold() -> None:
    s = make_scheduler(num_blocks=16, block_size=4)
    held, aborted = make_request("h", max_tokens=1), make_request("a", max_tokens=5)
    held.hold_kv = aborted.hold_kv = True
    s.add_request(held)
    s.add_request(aborted)
    step(s)
    s.abort_request("a")
    assert "a" not in s.held
    assert s.abort_request("h") is held
    assert_no_leaks(s)


def test_reserved_then_prefilled_request_decodes_without_recompute() -> None:
    s = make_scheduler(num_blocks=16, block_size=4)
    req = make_request("d", prompt_len=9, max_tokens=4)
    assert s.kv.reserve("d", 10) == s.kv.get_block_ids("d")
    assert s.kv.pool.num_cached_blocks == 0  # nothing cached before the KV has arrived
    with pytest.raises(ValueError, match="already holds"):
        s.kv.reserve("d", 4)
    req.num_computed_tokens = 9  # the KV of the prompt arrived
    req.output_token_ids.append(5)  # and P's first token
    s.add_prefilled(req)
    out = step(s, check=False)
    (only,) = out.scheduled
    assert (only.start_pos, only.token_ids, only.sample) == (9, [5], True)
    assert s.kv.pool.num_cached_blocks == 2  # full blocks registered on admission
    run_to_completion(s, check=False)
    assert req.output_token_ids == [5, 7, 7, 7]
    assert_no_leaks(s)


def test_add_prefilled_requires_reserved_blocks() -> None:
    s = make_scheduler()
    req = make_request("x")
    req.num_computed_tokens = 8
    with pytest.raises(ValueError, match="reserved"):
        s.add_prefilled(req)


def test_reserve_refuses_when_memory_is_short() -> None:
    s = make_scheduler(num_blocks=4, block_size=4)
    assert s.kv.reserve("a", 12) is not None
    assert s.kv.reserve("b", 8) is None and not s.kv.has_request("b")
    s.kv.free("a")
    assert_no_leaks(s)


def _prefilled(s, rid: str, prompt_len: int, max_tokens: int):  # type: ignore[no-untyped-def]
    req = make_request(rid, prompt_len=prompt_len, max_tokens=max_tokens)
    assert s.kv.reserve(rid, prompt_len) is not None
    req.num_computed_tokens = prompt_len  # the prompt's KV arrived from P
    req.output_token_ids.append(5)  # with P's first token
    return req


def test_prefilled_request_holding_blocks_is_not_stuck_behind_a_preempted_head() -> None:
    # 8 blocks of 4 tokens. `a` decodes until it must preempt itself while `b`'s KV (reserved
    # meanwhile) holds 3 blocks; `b` is admitted behind `a`, whose recompute (6 blocks) can never
    # fit while `b` holds its blocks. Found by the simulator: FIFO order alone stops both forever.
    s = make_scheduler(num_blocks=8, block_size=4, budget=64)
    a = _prefilled(s, "a", prompt_len=12, max_tokens=14)
    s.add_prefilled(a)
    while len(s.kv.get_block_ids("a")) < 4:
        step(s, check=False)
    b = _prefilled(s, "b", prompt_len=12, max_tokens=6)
    while a.num_preemptions == 0:
        step(s, check=False)
    s.add_prefilled(b)
    assert [r.request_id for r in s.waiting] == ["a", "b"]
    run_to_completion(s, check=False, max_steps=200)
    assert a.finished and b.finished
    assert len(b.output_token_ids) == 6 and len(a.output_token_ids) == 14
    assert_no_leaks(s)
