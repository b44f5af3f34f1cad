"""engine.scheduler: token budget, chunked prefill, decode-/prefill-first, preemption by recompute,
max_num_seqs, prefix caching, aborts, intake checks and stop conditions.

Every scenario ends with `assert_no_leaks`; `run_to_completion`/`step` check the per-step
invariants (budget, block tables, KV content through a fake cache) as they go.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from factories import (
    assert_no_leaks,
    det_token,
    fake_cache,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler, SchedulerOutput, SchedulerPolicy


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: s.num_tokens for s in out.scheduled}


def add(s: Scheduler, *requests: Request) -> None:
    for r in requests:
        s.add_request(r)


# ---- policy ----------------------------------------------------------------------------------
def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerPolicy(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerPolicy(max_num_seqs=0)


def test_empty_scheduler_schedules_nothing() -> None:
    s = make_scheduler()
    out = s.schedule()
    assert out.is_empty and out.num_batched_tokens == 0 and not out.preempted
    assert not s.has_unfinished()
    assert_no_leaks(s)


# ---- budget and chunking ---------------------------------------------------------------------
@pytest.mark.parametrize("decode_first", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
def test_token_budget_respected_every_step(chunked: bool, decode_first: bool) -> None:
    budget = 10
    s = make_scheduler(budget=budget, chunked=chunked, decode_first=decode_first)
    lengths = [3, 10, 7, 1, 9, 5, 2, 8] if not chunked else [3, 25, 7, 1, 40, 5, 2, 13]
    for i, n in enumerate(lengths):
        s.add_request(make_request(f"r{i}", prompt_len=n, max_tokens=3 + i % 4))
    res = run_to_completion(s)
    sizes = [out.num_batched_tokens for out in res.steps]
    assert max(sizes) <= budget
    assert budget in sizes  # the budget is actually filled when there is enough work
    assert all(len(res.outputs[f"r{i}"]) == 3 + i % 4 for i in range(len(lengths)))
    assert_no_leaks(s)


def test_chunked_prefill_splits_long_prompt_and_samples_on_last_chunk() -> None:
    s = make_scheduler(budget=8)
    req = make_request("long", prompt_len=30, max_tokens=3)
    s.add_request(req)
    chunks = []
    while req.num_output_tokens == 0:
        out = step(s)
        (sr,) = out.scheduled
        chunks.append(sr)
    assert [c.num_tokens for c in chunks] == [8, 8, 8, 6]
    assert [c.start_pos for c in chunks] == [0, 8, 16, 24]
    assert [c.sample for c in chunks] == [False, False, False, True]
    assert [t for c in chunks for t in c.token_ids] == req.prompt_token_ids
    assert req.num_computed_tokens == 30
    # Block tables grow with the chunks: 2, 4, 6, 8 blocks.
    assert [len(c.block_ids) for c in chunks] == [2, 4, 6, 8]
    res = run_to_completion(s)
    assert all(out.scheduled[0].num_tokens == 1 for out in res.steps)
    assert req.num_output_tokens == 3
    assert_no_leaks(s)


def test_a_step_cap_set_between_steps_chunks_a_prompt_finer_and_none_restores_the_budget() -> None:
    s = make_scheduler(budget=16)
    req = make_request("long", prompt_len=30, max_tokens=2)
    s.add_request(req)
    s.step_tokens = 4  # the thread mover's cap: a worker short of the host's cores
    assert scheduled(step(s)) == {"long": 4}
    assert scheduled(step(s)) == {"long": 4}
    s.step_tokens = None  # every core: the whole budget again
    assert scheduled(step(s)) == {"long": 16}
    s.step_tokens = 64  # a cap above the budget changes nothing
    assert scheduled(step(s)) == {"long": 6}
    run_to_completion(s)
    assert_no_leaks(s)
    # without chunked prefill a prompt runs whole or not at all: no cap may starve it
    whole = make_scheduler(budget=32, chunked=False)
    whole.add_request(make_request("w", prompt_len=30, max_tokens=2))
    whole.step_tokens = 4
    assert scheduled(step(whole)) == {"w": 30}


def _start_decodes(s: Scheduler, n: int = 3, max_tokens: int = 30) -> list[Request]:
    decs = [make_request(f"d{i}", prompt_len=2, max_tokens=max_tokens) for i in range(n)]
    add(s, *decs)
    out = step(s)
    assert scheduled(out) == {d.request_id: 2 for d in decs}
    return decs


def test_decode_first_keeps_every_decode_running_while_prompt_is_chunked() -> None:
    s = make_scheduler(budget=8)
    decs = _start_decodes(s)
    long = make_request("long", prompt_len=40, max_tokens=2)
    s.add_request(long)
    steps = 0
    while long.num_output_tokens == 0:
        out = step(s)
        steps += 1
        got = scheduled(out)
        assert all(got[d.request_id] == 1 for d in decs), got
        assert got["long"] == 5  # what the decodes leave of the budget
    assert steps == 8
    for d in decs:
        s.abort_request(d.request_id)
    run_to_completion(s)
    assert_no_leaks(s)


def test_prefill_first_runs_prompt_steps_without_decodes() -> None:
    s = make_scheduler(budget=8, decode_first=False)
    decs = _start_decodes(s)
    long = make_request("long", prompt_len=40, max_tokens=2)
    s.add_request(long)
    outs = []
    while long.num_output_tokens == 0:
        outs.append(step(s))
    assert [scheduled(o) for o in outs] == [{"long": 8}] * 5
    # With the prompt done, everyone decodes together again.
    out = step(s)
    assert scheduled(out) == {"d0": 1, "d1": 1, "d2": 1, "long": 1}
    assert all(d.num_output_tokens == 2 for d in decs)  # they waited five steps
    run_to_completion(s)
    assert_no_leaks(s)


def test_prefill_first_still_decodes_when_no_prompt_can_be_admitted() -> None:
    s = make_scheduler(budget=8, decode_first=False, max_num_seqs=3)
    _start_decodes(s)
    s.add_request(make_request("late", prompt_len=4))  # max_num_seqs reached: cannot be admitted
    out = step(s)
    assert scheduled(out) == {"d0": 1, "d1": 1, "d2": 1}
    assert s.num_waiting == 1
    run_to_completion(s)
    assert_no_leaks(s)


def test_without_chunking_a_prompt_waits_until_it_fits_whole() -> None:
    s = make_scheduler(budget=8, chunked=False)
    add(s, make_request("a", prompt_len=4, max_tokens=3), make_request("b", prompt_len=4))
    assert scheduled(step(s)) == {"a": 4, "b": 4}
    c = make_request("c", prompt_len=7, max_tokens=2)
    s.add_request(c)
    assert scheduled(step(s)) == {"a": 1, "b": 1}  # 6 left < 7: c waits
    assert scheduled(step(s)) == {"a": 1, "b": 1}  # a finishes here
    assert scheduled(step(s)) == {"b": 1, "c": 7}  # the whole prompt at once
    res = run_to_completion(s)
    assert len(res.outputs["c"]) == 2
    assert_no_leaks(s)


def test_with_chunking_the_same_prompt_starts_at_once() -> None:
    s = make_scheduler(budget=8, chunked=True)
    add(s, make_request("a", prompt_len=4, max_tokens=3), make_request("b", prompt_len=4))
    step(s)
    s.add_request(make_request("c", prompt_len=7, max_tokens=2))
    assert scheduled(step(s)) == {"a": 1, "b": 1, "c": 6}
    run_to_completion(s)
    assert_no_leaks(s)


def test_without_chunking_a_prompt_larger_than_the_budget_is_refused() -> None:
    # It could never run whole, and waiting forever would block everything queued behind it.
    s = make_scheduler(budget=8, chunked=False)
    with pytest.raises(ValueError, match="chunked prefill"):
        s.add_request(make_request("big", prompt_len=12))
    assert s.num_waiting == 0
    assert_no_leaks(s)


def test_max_num_seqs_caps_running() -> None:
    s = make_scheduler(max_num_seqs=2)
    for i in range(5):
        s.add_request(make_request(f"r{i}", prompt_len=4, max_tokens=3))
    first = step(s)
    assert scheduled(first) == {"r0": 4, "r1": 4}
    assert s.num_running == 2 and s.num_waiting == 3
    res = run_to_completion(s)  # check_step asserts running <= 2 every step
    admitted = []
    for out in [first, *res.steps]:
        admitted += [x.request_id for x in out.scheduled if x.start_pos == 0]
    assert admitted == [f"r{i}" for i in range(5)]  # FIFO
    assert all(len(v) == 3 for v in res.outputs.values())
    assert_no_leaks(s)


# ---- preemption ------------------------------------------------------------------------------
def _reference_outputs(requests: list[tuple[str, int, int]]) -> dict[str, list[int]]:
    """Outputs of an unconstrained run (plenty of blocks, budget and seats)."""
    s = make_scheduler(num_blocks=512, budget=4096, max_num_seqs=64)
    for rid, p, m in requests:
        s.add_request(make_request(rid, prompt=_prompt(rid, p), max_tokens=m, ignore_eos=True))
    res = run_to_completion(s, det_token)
    assert s.num_preemptions == 0
    assert_no_leaks(s)
    return res.outputs


def _prompt(rid: str, n: int) -> list[int]:
    return [1000 + 10 * ord(rid[-1]) + i for i in range(n)]


def test_preemption_recomputes_most_recent_request() -> None:
    specs = [("a", 6, 10), ("b", 6, 10), ("c", 6, 10), ("d", 6, 10)]
    s = make_scheduler(num_blocks=6, budget=64, caching=False)
    reqs = {
        rid: make_request(rid, prompt=_prompt(rid, p), max_tokens=m, ignore_eos=True)
        for rid, p, m in specs
    }
    add(s, *reqs.values())
    # Step 1: a, b, c take two blocks each; d does not fit.
    assert scheduled(step(s, det_token)) == {"a": 6, "b": 6, "c": 6}
    assert scheduled(step(s, det_token)) == {"a": 1, "b": 1, "c": 1}
    assert scheduled(step(s, det_token)) == {"a": 1, "b": 1, "c": 1}
    c = reqs["c"]
    outputs_before = list(c.output_token_ids)
    assert len(outputs_before) == 3
    # Step 4: slot 8 needs a third block each; c, admitted last, is preempted for a and b.
    running_before = [r.request_id for r in s.running]
    out = step(s, det_token)
    assert out.preempted == ["c"] == running_before[-1:]
    assert scheduled(out) == {"a": 1, "b": 1}
    assert [r.request_id for r in s.waiting] == ["c", "d"]  # at the front, ahead of d
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.output_token_ids == outputs_before and c.num_preemptions == 1
    assert not s.kv.has_request("c")
    assert s.num_preemptions == 1

    res = run_to_completion(s, det_token)
    later = [x for o in res.steps for x in o.scheduled if x.request_id == "c"]
    assert later[0].start_pos == 0
    assert later[0].token_ids == c.prompt_token_ids + outputs_before  # recompute
    assert later[0].sample
    assert res.outputs == _reference_outputs(specs)  # same tokens as without pressure
    assert all(len(v) == 10 for v in res.outputs.values())
    assert_no_leaks(s)


@pytest.mark.parametrize("decode_first", [True, False])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("budget", [5, 16, 64])
def test_preemption_keeps_outputs_identical(budget: int, caching: bool, decode_first: bool) -> None:
    specs = [(f"r{i}", 3 + 5 * (i % 3), 6 + 3 * (i % 4)) for i in range(8)]
    s = make_scheduler(num_blocks=8, budget=budget, caching=caching, decode_first=decode_first)
    for rid, p, m in specs:
        s.add_request(make_request(rid, prompt=_prompt(rid, p), max_tokens=m, ignore_eos=True))
    res = run_to_completion(s, det_token, max_steps=5000)
    assert s.num_preemptions > 0
    assert res.outputs == _reference_outputs(specs)
    for rid, _, m in specs:
        assert len(res.outputs[rid]) == m
    # Every recompute resumes with the request's whole context, chunk after chunk.
    for o in res.steps:
        for x in o.scheduled:
            req = res.requests[x.request_id]
            assert x.token_ids == req.all_token_ids[x.start_pos : x.start_pos + x.num_tokens]
    assert_no_leaks(s)


def test_several_preemptions_in_one_step_newest_first() -> None:
    s = make_scheduler(num_blocks=8, budget=64, caching=False)
    s.add_request(make_request("old", prompt_len=18, max_tokens=12, ignore_eos=True))  # 5 blocks
    step(s)
    for rid in ("x", "y", "z"):
        s.add_request(make_request(rid, prompt_len=4, max_tokens=4, ignore_eos=True))
    assert scheduled(step(s)) == {"old": 1, "x": 4, "y": 4, "z": 4}  # all 8 blocks in use
    # x, y and z each need a second block now: x takes z's, y finds none left but its own.
    out = step(s)
    assert out.preempted == ["z", "y"]
    assert scheduled(out) == {"old": 1, "x": 1}
    assert [r.request_id for r in s.waiting] == ["y", "z"]  # y was admitted first, resumes first
    assert [r.request_id for r in s.running] == ["old", "x"]
    res = run_to_completion(s)
    assert {k: len(v) for k, v in res.outputs.items()} == {"old": 12, "x": 4, "y": 4, "z": 4}
    assert_no_leaks(s)


def test_non_chunked_recompute_that_outgrows_the_budget_still_finishes() -> None:
    """Regression: without chunking, a preempted request whose prompt plus outputs exceeded the
    whole budget could never run whole again and waited forever."""
    specs = [("a", 8, 8), ("b", 4, 8)]
    s = make_scheduler(num_blocks=6, budget=8, chunked=False, caching=False)
    for rid, p, m in specs:
        s.add_request(make_request(rid, prompt=_prompt(rid, p), max_tokens=m, ignore_eos=True))
    res = run_to_completion(s, det_token, max_steps=200)
    # b is preempted with 5 outputs: 9 tokens to recompute, more than the budget of 8.
    assert s.num_preemptions == 1
    b_rows = [
        (x.start_pos, x.num_tokens) for o in res.steps for x in o.scheduled if x.request_id == "b"
    ]
    assert (0, 7) in b_rows and (7, 2) in b_rows  # recomputed in two chunks
    # A fresh prompt is still never split.
    assert all(
        x.num_tokens == 1
        for o in res.steps
        for x in o.scheduled
        if x.request_id == "a" and x.start_pos > 0
    )
    assert res.outputs == _reference_outputs(specs)
    assert_no_leaks(s)


# ---- prefix caching --------------------------------------------------------------------------
def test_prefix_cache_hit_skips_shared_tokens() -> None:
    shared = list(range(500, 512))  # 3 full blocks
    s = make_scheduler(budget=64)
    a = make_request("a", prompt=[*shared, 1, 2, 3], max_tokens=4)
    s.add_request(a)
    first = step(s)
    assert scheduled(first) == {"a": 15}
    b = make_request("b", prompt=[*shared, 7, 8, 9, 10, 11], max_tokens=4)
    s.add_request(b)
    out = step(s)
    (sb,) = [x for x in out.scheduled if x.request_id == "b"]
    assert sb.start_pos == 12 and sb.num_tokens == 5
    assert b.num_cached_tokens == 12
    assert sb.block_ids[:3] == first.scheduled[0].block_ids[:3]  # shared physical blocks
    assert s.kv.stats.hits == 12
    run_to_completion(s)
    assert_no_leaks(s)

    # After both finished, the same prompt again hits the (free, still cached) blocks.
    c = make_request("c", prompt=[*shared, 1, 2, 3], max_tokens=1)
    s.add_request(c)
    out = step(s)
    assert out.scheduled[0].start_pos == 12 and c.num_cached_tokens == 12
    assert_no_leaks(s)


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_schedules_fewer_tokens(caching: bool) -> None:
    shared = list(range(700, 716))  # 4 full blocks
    s = make_scheduler(budget=64, caching=caching)
    s.add_request(make_request("first", prompt=[*shared, 1], max_tokens=2))
    run_to_completion(s)
    s.add_request(make_request("second", prompt=[*shared, 2, 3], max_tokens=2))
    res = run_to_completion(s)
    total = sum(o.num_batched_tokens for o in res.steps)
    # 18 prompt tokens + 1 decode; with caching the 16 shared ones are skipped.
    assert total == (3 if caching else 19)
    assert res.requests["second"].num_cached_tokens == (16 if caching else 0)
    assert_no_leaks(s)


def test_identical_prompts_in_one_step_share_blocks_and_kv_stays_consistent() -> None:
    prompt = list(range(900, 913))
    s = make_scheduler(budget=64)
    for rid in ("a", "b", "c"):
        s.add_request(make_request(rid, prompt=prompt, max_tokens=5, ignore_eos=True))
    res = run_to_completion(s, det_token)
    first = res.steps[0]
    assert scheduled(first) == {"a": 13, "b": 1, "c": 1}
    tables = {x.request_id: x.block_ids for x in first.scheduled}
    assert tables["a"][:3] == tables["b"][:3] == tables["c"][:3]
    assert_no_leaks(s)


# ---- aborts ----------------------------------------------------------------------------------
def test_abort_from_waiting_and_running_frees_blocks() -> None:
    s = make_scheduler(num_blocks=4, budget=64)
    a = make_request("a", prompt_len=12, max_tokens=4)  # 3 blocks now, up to 4
    b = make_request("b", prompt_len=8, max_tokens=2)  # 2 blocks: does not fit beside a
    add(s, a, b)
    step(s)
    assert s.num_running == 1 and s.num_waiting == 1
    assert s.kv.num_free_blocks == 1
    assert s.abort_request("b") is b
    assert b.status == RequestStatus.FINISHED_ABORTED and b.status.finish_reason == "abort"
    assert s.num_waiting == 0 and not s.kv.has_request("b")
    assert s.abort_request("a") is a
    assert a.finished and s.num_running == 0
    assert s.kv.num_free_blocks == 4
    assert s.schedule().is_empty
    assert_no_leaks(s)


def test_abort_of_preempted_request() -> None:
    s = make_scheduler(num_blocks=6, budget=64, caching=False)
    for rid in "abc":
        s.add_request(make_request(rid, prompt_len=6, max_tokens=10))
    for _ in range(4):
        out = step(s)
    assert out.preempted == ["c"]
    s.abort_request("c")
    res = run_to_completion(s)
    assert len(res.outputs["a"]) == len(res.outputs["b"]) == 10
    assert_no_leaks(s)


def test_abort_between_schedule_and_update() -> None:
    s = make_scheduler()
    a = make_request("a", prompt_len=5)
    b = make_request("b", prompt_len=5)
    add(s, a, b)
    out = s.schedule()
    fake_cache(s).step(s, out)  # keep the fake KV in step for the checks further on
    s.abort_request("a")
    finished = s.update_from_output(out, {"a": 7, "b": 7})
    assert finished == []
    assert a.output_token_ids == [] and b.output_token_ids == [7]
    run_to_completion(s)
    assert_no_leaks(s)


def test_abort_of_unknown_id_is_a_noop() -> None:
    s = make_scheduler()
    s.add_request(make_request("a"))
    step(s)
    free = s.kv.num_free_blocks
    assert s.abort_request("nope") is None
    s.finish_request("nope", RequestStatus.FINISHED_STOPPED)
    assert s.kv.num_free_blocks == free and s.num_running == 1
    s.abort_request("a")
    assert s.abort_request("a") is None  # twice: the second is unknown
    assert_no_leaks(s)


# ---- intake ----------------------------------------------------------------------------------
def test_duplicate_id_raises() -> None:
    s = make_scheduler()
    s.add_request(make_request("same", max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("same"))
    assert s.num_waiting == 1
    run_to_completion(s)
    s.add_request(make_request("same", max_tokens=1))  # free again once finished
    run_to_completion(s)
    assert_no_leaks(s)


def test_request_larger_than_the_cache_raises_at_add() -> None:
    s = make_scheduler(num_blocks=4)  # 16 slots
    with pytest.raises(ValueError, match="more KV blocks than the cache"):
        s.add_request(make_request("huge", prompt_len=17, max_tokens=1))
    # The prompt fits, but prompt plus max_tokens could not: refused too (it would otherwise
    # preempt itself forever once it outgrew the cache).
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_request(make_request("long", prompt_len=8, max_tokens=10))
    assert not s.has_unfinished()
    assert_no_leaks(s)


@pytest.mark.parametrize(("prompt_len", "max_tokens"), [(16, 1), (15, 2), (8, 9), (1, 16)])
def test_request_that_exactly_fills_the_cache_completes(prompt_len: int, max_tokens: int) -> None:
    # The last generated token is never computed, so prompt + max_tokens - 1 slots suffice.
    s = make_scheduler(num_blocks=4, budget=64)
    s.add_request(make_request("r", prompt_len=prompt_len, max_tokens=max_tokens, ignore_eos=True))
    res = run_to_completion(s, max_steps=100)
    assert len(res.outputs["r"]) == max_tokens
    assert s.num_preemptions == 0
    assert_no_leaks(s)


def test_max_model_len_bounds_the_intake_check() -> None:
    s = make_scheduler(num_blocks=4)
    # max_tokens alone would overflow, but the context ends at 16 tokens: 15 need KV.
    s.add_request(make_request("r", prompt_len=8, max_tokens=100, max_model_len=16))
    res = run_to_completion(s, max_steps=100)
    assert len(res.outputs["r"]) == 8
    assert res.requests["r"].status == RequestStatus.FINISHED_LENGTH
    assert_no_leaks(s)


# ---- stop conditions ---------------------------------------------------------------------------
def _finish(token_fn, **kw) -> Request:  # type: ignore[no-untyped-def]
    s = make_scheduler()
    req = make_request("r", prompt_len=5, **kw)
    s.add_request(req)
    finished: list[Request] = []
    for _ in range(50):
        out = s.schedule()
        sampled = {x.request_id: token_fn(req) for x in out.scheduled if x.sample}
        finished += s.update_from_output(out, sampled)
        if not s.has_unfinished():
            break
    assert finished == [req]
    assert_no_leaks(s)
    return req


def test_eos_stops() -> None:
    req = _finish(lambda r: 2, max_tokens=5, eos_token_ids=(2,))
    assert req.output_token_ids == [2]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.status.finish_reason == "stop"
    assert req.stop_reason is None


def test_ignore_eos_runs_to_max_tokens() -> None:
    req = _finish(lambda r: 2, max_tokens=5, eos_token_ids=(2,), ignore_eos=True)
    assert req.output_token_ids == [2] * 5
    assert req.status == RequestStatus.FINISHED_LENGTH and req.status.finish_reason == "length"


def test_stop_token_ids_stop_with_reason() -> None:
    seq = iter([5, 6, 9, 5, 5])
    req = _finish(lambda r: next(seq), max_tokens=5, stop_token_ids=[9, 10])
    assert req.output_token_ids == [5, 6, 9]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 9


def test_stop_token_ids_apply_even_with_ignore_eos() -> None:
    req = _finish(lambda r: 9, max_tokens=5, stop_token_ids=[9], ignore_eos=True)
    assert req.output_token_ids == [9] and req.stop_reason == 9


def test_max_tokens_gives_length() -> None:
    req = _finish(lambda r: 3, max_tokens=4, eos_token_ids=(2,))
    assert req.output_token_ids == [3] * 4
    assert req.status.finish_reason == "length" and req.stop_reason is None


def test_max_model_len_gives_length() -> None:
    req = _finish(lambda r: 3, max_tokens=10, max_model_len=7)
    assert req.num_output_tokens == 2 and req.status == RequestStatus.FINISHED_LENGTH


def test_finish_request_from_outside() -> None:
    s = make_scheduler()
    req = make_request("r", prompt_len=5, max_tokens=10)
    s.add_request(req)
    step(s)
    s.finish_request("r", RequestStatus.FINISHED_STOPPED)  # e.g. a stop string in the text
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert s.schedule().is_empty
    assert_no_leaks(s)


# ---- property test ---------------------------------------------------------------------------
@st.composite
def workloads(draw):  # type: ignore[no-untyped-def]
    block_size = draw(st.sampled_from([1, 2, 4]))
    cfg = dict(
        num_blocks=max(2, draw(st.integers(8, 48)) // block_size),  # 8 to 48 slots: tight
        block_size=block_size,
        budget=draw(st.integers(1, 40)),
        max_num_seqs=draw(st.integers(1, 6)),
        chunked=draw(st.booleans()),
        decode_first=draw(st.booleans()),
        caching=draw(st.booleans()),
        # a sliding window on every layer: blocks that leave it are freed as requests run
        window=draw(st.one_of(st.none(), st.integers(1, 12))),
    )
    prefixes = [list(range(100 * g, 100 * g + 12)) for g in range(1, 4)]
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        plen = draw(st.integers(1, 20))
        if not cfg["chunked"]:
            plen = min(plen, cfg["budget"])  # larger prompts would wait forever, by design
        group = draw(st.integers(0, 3))
        shared = prefixes[group - 1][: draw(st.integers(0, plen))] if group else []
        prompt = shared + [5000 + 100 * i + k for k in range(plen - len(shared))]
        reqs.append(
            dict(
                rid=f"r{i}",
                prompt=prompt,
                max_tokens=draw(st.integers(1, 10)),
                arrival=draw(st.integers(0, 8)),
                abort=draw(st.one_of(st.none(), st.none(), st.integers(0, 30))),
            )
        )
    return cfg, reqs


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads())
def test_random_workloads_keep_invariants(workload) -> None:  # type: ignore[no-untyped-def]
    cfg, specs = workload
    s = make_scheduler(**cfg)
    accepted: dict[str, Request] = {}
    aborted: set[str] = set()

    def before_step(i: int, sched: Scheduler) -> None:
        for spec in specs:
            rid = spec["rid"]
            if spec["arrival"] == i:
                req = make_request(
                    rid, prompt=spec["prompt"], max_tokens=spec["max_tokens"], ignore_eos=True
                )
                kv_tokens = len(spec["prompt"]) + spec["max_tokens"] - 1
                need = sched.kv.peak_blocks(kv_tokens, sched.policy.max_num_batched_tokens)
                if need > sched.kv.num_blocks:
                    with pytest.raises(ValueError):
                        sched.add_request(req)
                    continue
                sched.add_request(req)
                accepted[rid] = req
            abort_at = spec["abort"]
            if abort_at is not None and abort_at == i and rid in sched.requests:
                sched.abort_request(rid)
                aborted.add(rid)

    last_arrival = max(spec["arrival"] for spec in specs)

    def hook(i: int, sched: Scheduler) -> None:
        before_step(i, sched)
        if i < last_arrival and not sched.has_unfinished():
            # Keep the loop alive until every arrival happened.
            sched.add_request(make_request(f"idle{i}", prompt_len=1, max_tokens=1))

    run_to_completion(s, det_token, max_steps=3000, before_step=hook)
    assert_no_leaks(s)
    for spec in specs:
        rid = spec["rid"]
        if rid not in accepted:
            continue
        req = accepted[rid]
        out = req.output_token_ids
        expected = [
            det_token(Request(rid, [0] * (len(spec["prompt"]) + k), req.sampling_params))
            for k in range(len(out))
        ]
        assert out == expected  # the tokens depend only on (id, position): no mix-ups
        if rid in aborted:
            assert len(out) <= spec["max_tokens"]
        else:
            assert len(out) == spec["max_tokens"]
            assert req.status == RequestStatus.FINISHED_LENGTH
