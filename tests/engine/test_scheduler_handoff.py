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
