"""Stall-free batching: a per-step prompt-token budget from the TPOT SLO and the cost model."""

from __future__ import annotations

import dataclasses

import pytest

from factories import assert_no_leaks, make_request, make_scheduler, run_to_completion, step
from pdserve.costmodel.model import CostModel
from pdserve.engine.scheduler import SchedulerPolicy
from pdserve.engine.step_budget import tpot_prefill_budget


def scheduled(out) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {s.request_id: s.num_tokens for s in out.scheduled}


def _decoding(s, n: int = 3):  # type: ignore[no-untyped-def]
    decs = [make_request(f"d{i}", prompt_len=2, max_tokens=30) for i in range(n)]
    for d in decs:
        s.add_request(d)
    step(s)  # their prompts
    return decs


def test_prompt_tokens_limited_by_budget_while_decodes_run() -> None:
    calls: list[tuple[int, int, int]] = []

    def budget(batch: int, context: int, cached: int) -> int:
        calls.append((batch, context, cached))
        return 4

    s = make_scheduler(budget=64, prefill_budget=budget)
    decs = _decoding(s)
    long = make_request("long", prompt_len=40, max_tokens=2)
    s.add_request(long)
    out = step(s)
    got = scheduled(out)
    assert all(got[d.request_id] == 1 for d in decs)
    assert got["long"] == 4  # not the 61 the token budget leaves
    assert calls[-1] == (3, 3 * 3, 0)  # 3 decodes, each at position 2 -> 3 keys; a new prompt
    out = step(s)  # the running chunk continues under the same budget, priced after its 4
    assert scheduled(out)["long"] == 4
    assert calls[-1] == (3, 3 * 4, 4)
    for d in decs:
        s.abort_request(d.request_id)
    res = run_to_completion(s)
    assert res.requests["long"].num_output_tokens == 2
    assert_no_leaks(s)


def test_without_decodes_prompts_use_the_whole_token_budget() -> None:
    s = make_scheduler(budget=32, prefill_budget=lambda b, c, k: 1)
    s.add_request(make_request("p", prompt_len=40, max_tokens=1))
    assert scheduled(step(s)) == {"p": 32}
    run_to_completion(s)
    assert_no_leaks(s)


def test_zero_budget_defers_prompts_but_decodes_finish_and_then_prompts_run() -> None:
    s = make_scheduler(budget=32, prefill_budget=lambda b, c, k: 0)
    decs = _decoding(s, 2)
    s.add_request(make_request("late", prompt_len=10, max_tokens=3))
    out = step(s)
    assert set(scheduled(out)) == {d.request_id for d in decs}
    res = run_to_completion(s)
    assert res.requests["late"].num_output_tokens == 3
    assert_no_leaks(s)


def test_budget_needs_decode_first() -> None:
    with pytest.raises(ValueError, match="decode_first"):
        SchedulerPolicy(decode_first=False, prefill_budget=lambda b, c, k: 8)


def _cost() -> CostModel:
    # 30 ms a decode step + 1 ms per 1k tokens of context; 0.5 ms per prompt token
    return CostModel(prefill=(0.02, 0.0005, 0.0), decode=(0.03, 0.001, 0.001), transfer=(0.0, 1e9))


def test_tpot_budget_from_cost_model() -> None:
    budget = tpot_prefill_budget(_cost(), tpot_s=0.1, max_tokens=2048)
    # 0.03 + 0.001 * 4 + 0.004 (4k context) = 0.038 s of decodes: 62 ms left = 124 tokens
    assert budget(4, 4000) == 124
    assert budget(200, 100_000) == 1  # decodes alone exceed the SLO: the minimum chunk
    assert tpot_prefill_budget(_cost(), tpot_s=10.0, max_tokens=512)(1, 10) == 512
    with pytest.raises(ValueError):
        tpot_prefill_budget(_cost(), tpot_s=0.0, max_tokens=512)


def test_many_requests_under_budget_finish_without_leaks() -> None:
    s = make_scheduler(
        budget=48, num_blocks=96, prefill_budget=tpot_prefill_budget(_cost(), 0.05, 48, 2)
    )
    for i in range(12):
        s.add_request(make_request(f"r{i}", prompt_len=3 + 5 * i, max_tokens=6))
    res = run_to_completion(s)
    assert all(r.num_output_tokens == 6 for r in res.requests.values())
    assert_no_leaks(s)


def test_worker_builds_the_budget_from_slo_and_cost_model_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pdserve.config import EngineConfig, WorkerConfig
    from pdserve.launcher import WorkerSpec, worker_command
    from pdserve.workers.worker import stall_free_budget

    config = EngineConfig.from_kwargs(max_num_batched_tokens=512)
    assert stall_free_budget(config, None, None) is None
    with pytest.raises(ValueError, match="cost-model"):
        stall_free_budget(config, 0.1, None)
    path = tmp_path / "cost.json"
    _cost().save(path)
    budget = stall_free_budget(config, 0.1, str(path))
    assert budget is not None and budget(4, 4000) == 124
    spec = WorkerSpec("colocated", "C0", config=WorkerConfig(slo_tpot_s=0.1, cost_model=str(path)))
    cmd = worker_command(spec)
    assert cmd[cmd.index("--slo-tpot") + 1] == "0.1"
    assert cmd[cmd.index("--cost-model") + 1] == str(path)


def test_serve_hands_the_slo_to_decoding_workers_only() -> None:
    from pdserve.costmodel.model import CostModel as Cost
    from pdserve.deployment import Deployment, PlannerConfig
    from pdserve.launcher import WorkerSpec
    from pdserve.serve.plan import with_stall_free

    specs = [WorkerSpec(r, r[0]) for r in ("prefill", "decode", "colocated")]
    planner = PlannerConfig(stall_free=True, slo_tpot_s=0.2, cost_model="c.json")
    got = with_stall_free(Deployment(planner=planner), specs, Cost((0, 0, 0), (0, 0, 0)), 1)
    assert [(s.config.slo_tpot_s, s.config.cost_model) for s in got] == [
        (None, None),
        (0.2, "c.json"),
        (0.2, "c.json"),
    ]
    off = Deployment(planner=dataclasses.replace(planner, stall_free=False))
    assert with_stall_free(off, specs, Cost((0, 0, 0), (0, 0, 0)), 1) == specs


def test_budget_learns_that_steps_run_slower_than_the_cost_model_says() -> None:
    budget = tpot_prefill_budget(_cost(), tpot_s=0.1, max_tokens=2048, smoothing=1.0)
    before = budget(4, 4000)
    budget.observe(4, 4000, 100, 2 * budget.predict_s(4, 4000, 100))  # twice as slow
    assert budget.ratio == pytest.approx(2.0)
    # 2 * (0.038 + 0.0005 n) <= 0.1  ->  n <= 24
    assert budget(4, 4000) == 24 < before
    budget.observe(0, 0, 500, 100.0)  # a step without decodes teaches nothing
    assert budget.ratio == pytest.approx(2.0)
    budget.observe(4, 4000, 0, 1e6)  # clamped
    assert budget.ratio == 8.0


def _cost_with_attention() -> CostModel:
    # as _cost, plus 0.01 ms per prompt token per 1k tokens it attends to
    return CostModel(
        prefill=(0.02, 0.0005, 0.00001), decode=(0.03, 0.001, 0.001), transfer=(0.0, 1e9)
    )


def test_a_chunk_deep_into_a_long_prompt_gets_fewer_tokens() -> None:
    budget = tpot_prefill_budget(_cost_with_attention(), tpot_s=0.1, max_tokens=2048)
    at_start, deep = budget(4, 4000, 0), budget(4, 4000, 2000)
    assert deep < at_start
    for n, cached in ((at_start, 0), (deep, 2000)):  # each is the largest chunk that fits
        assert (
            budget.predict_s(4, 4000, n, cached) <= 0.1 < budget.predict_s(4, 4000, n + 1, cached)
        )
    # what the engine observes is priced the same way: a deep chunk that took its predicted
    # time teaches no slowdown
    budget.observe(4, 4000, deep, budget.predict_s(4, 4000, deep, 2000), cached=2000)
    assert budget.ratio == pytest.approx(1.0)


def test_the_waiting_heads_cached_prefix_prices_its_first_chunk_without_counting_a_query() -> None:
    calls: list[int] = []

    def budget(batch: int, context: int, cached: int) -> int:
        calls.append(cached)
        return 4

    s = make_scheduler(budget=64, num_blocks=64, prefill_budget=budget)
    prompt = list(range(500, 533))
    s.add_request(make_request("first", max_tokens=1, prompt=prompt))
    run_to_completion(s)  # its 8 full blocks of 4 stay cached
    _decoding(s, 1)
    queries = s.kv.stats.queries
    s.add_request(make_request("again", max_tokens=1, prompt=prompt))
    step(s)
    assert calls[-1] == 32
    assert s.kv.stats.queries - queries == 33  # the admission's own lookup, counted once
