"""SLO scheduling end to end: real workers (child processes, tcp) on the tiny model, driven
through LocalCluster (the same RouterCore as the server). One test per feature: admission,
conditional disaggregation, prefix-aware routing, a role switch under load."""

from __future__ import annotations

import time

import pytest

from factories import assert_cluster_idle, eventually
from pdserve import LLM, SamplingParams
from pdserve.cluster import LocalCluster
from pdserve.costmodel.model import CostModel
from pdserve.router.slo import SloPlanner

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# roughly the tiny model on one thread; exactness does not matter, only the orderings
TINY = CostModel((0.002, 2e-5, 0.0), (0.002, 1e-4, 0.0), (0.0005, 1e9))
ENGINE = {"block_size": 16}


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    return [[(seed * 131 + i * 17 + j) % 900 + 50 for j in range(length)] for i in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_llama_path):  # type: ignore[no-untyped-def]
    return LLM(str(tiny_llama_path), **ENGINE)


def reference(llm: LLM, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def cluster(path, planner: SloPlanner, **kw) -> LocalCluster:  # type: ignore[no-untyped-def]
    return LocalCluster(
        str(path), threads=1, engine_args=ENGINE, core_args={"planner": planner}, **kw
    )


def test_admission_refuses_before_any_worker_sees_the_request(tiny_llama_path, llm) -> None:  # type: ignore[no-untyped-def]
    slow = CostModel((0.0, 0.01, 0.0), TINY.decode, TINY.transfer)  # 10 ms a token: 64 = 0.64 s
    planner = SloPlanner(slow, slo_ttft_s=0.3, slo_tpot_s=1.0)
    batch = prompts(2, 8) + prompts(1, 64, seed=3)
    with cluster(tiny_llama_path, planner) as c:
        t0 = time.monotonic()
        outs = c.generate(batch, GREEDY, timeout_s=60)
        assert [o.outputs[0].token_ids for o in outs[:2]] == reference(llm, batch[:2])
        refused = outs[2]
        assert refused.outputs[0].finish_reason == "error" and "TTFT SLO" in (refused.error or "")
        assert c.stats["rejected_slo_ttft"] == 1 and c.stats["requests_rejected"] == 1
        assert time.monotonic() - t0 < 60
        timeline = c.core.raw_timeline(refused.request_id) if c.core else None
        assert timeline and not any(e.startswith("route") for e, _, _ in timeline)
        assert_cluster_idle(c)


def test_conditional_prefills_short_prompts_on_d_and_output_is_exact(tiny_llama_path, llm) -> None:  # type: ignore[no-untyped-def]
    planner = SloPlanner(TINY)
    batch = prompts(3, 20, seed=5)
    with cluster(tiny_llama_path, planner) as c:
        outs = c.generate(batch[:1], GREEDY, timeout_s=60)  # idle: no reason to pay a transfer
        outs += c.generate(batch[1:], GREEDY, timeout_s=60)
        assert [o.outputs[0].token_ids for o in outs] == reference(llm, batch)
        assert c.stats["route_local"] >= 1
        assert c.core is not None
        first = c.core.prediction(outs[0].request_id)
        assert first is not None and first["route"] == "local" and first["workers"] == ["D0"]
        assert first["actual_ttft_s"] > 0 and first["actual_tpot_s"] > 0
        assert_cluster_idle(c)
    always = SloPlanner(TINY, mode="always")
    with cluster(tiny_llama_path, always) as c:
        outs = c.generate(batch, GREEDY, timeout_s=60)
        assert [o.outputs[0].token_ids for o in outs] == reference(llm, batch)
        assert c.stats["route_remote"] == 3 and c.stats["route_local"] == 0
        assert_cluster_idle(c)


def test_prefix_routing_finds_the_cached_prefix_on_p_and_d(tiny_llama_path, llm) -> None:  # type: ignore[no-untyped-def]
    planner = SloPlanner(TINY, mode="always")
    base = prompts(1, 96, seed=7)[0]
    follow = [*base, 77, 78, 79, 80, 81]
    with cluster(tiny_llama_path, planner, prefill=2, decode=1) as c:
        first = c.generate([base], GREEDY, timeout_s=60)
        assert c.core is not None
        indexed = lambda: max(c.core.prefix.match(base, 16, ["P0", "P1"]).values()) >= 96  # type: ignore[union-attr]  # noqa: E731
        eventually(indexed, 10, "P's KVEvents to reach the router")
        second = c.generate([follow], GREEDY, timeout_s=60)
        assert [first[0].outputs[0].token_ids, second[0].outputs[0].token_ids] == reference(
            llm, [base, follow]
        )
        assert c.core is not None
        p1 = c.core.prediction(first[0].request_id)
        p2 = c.core.prediction(second[0].request_id)
        assert p1 is not None and p2 is not None
        assert p2["workers"][0] == p1["workers"][0]  # the P that holds the prefix
        assert p2["cached_prefill_tokens"] == 96 and p2["cached_decode_tokens"] == 96
        assert_cluster_idle(c)


def test_role_switch_under_load_loses_no_request_and_leaks_no_block(tiny_llama_path, llm) -> None:  # type: ignore[no-untyped-def]
    planner = SloPlanner(TINY)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    batch = prompts(8, 48, seed=11)
    with cluster(tiny_llama_path, planner, prefill=1, decode=2) as c:
        _, pending = c.submit(batch, params)
        eventually(lambda: c.stats["route_remote"] + c.stats["route_local"] > 0, 30, "dispatch")
        row = c.set_role("D1", "prefill")
        assert row["role"] == "prefill" and row["healthy"]
        after = c.generate(prompts(2, 48, seed=12), params, timeout_s=120)
        outs = pending.result(timeout=120)
        got = [o.outputs[0].token_ids for o in outs + after]
        assert got == reference(llm, batch + prompts(2, 48, seed=12), params)
        assert all(o.error is None for o in outs + after)
        assert c.stats["role_switches_admin"] == 1
        assert [w.role for w in c.core.workers] == ["prefill", "decode", "prefill"]  # type: ignore[union-attr]
        assert_cluster_idle(c)


def test_autobalance_moves_a_decode_worker_to_prefill_and_loses_nothing(
    tiny_llama_path, llm
) -> None:  # type: ignore[no-untyped-def]
    from pdserve.router.balancer import Autobalancer

    # P's engine steps are made slow (1 s each, injected), so prompts pile up on P while the
    # D's idle: the controller must move one D to the prefill pool, and nothing may be lost
    planner = SloPlanner(TINY, slo_ttft_s=0.2, admission=False, mode="always")
    auto = Autobalancer(sustain_s=0.3, cooldown_s=60.0)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    batch = prompts(12, 120, seed=13)
    core_args = {"planner": planner, "autobalancer": auto, "autobalance_interval_s": 0.1}
    with LocalCluster(
        str(tiny_llama_path), 1, 2, threads=1, engine_args=ENGINE, core_args=core_args
    ) as c:
        c.set_fault("P0", "slow", count=3, delay_s=1.0)
        outs = c.generate(batch, params, timeout_s=120)
        assert c.stats["autobalance_to_prefill"] == 1  # decided while the prompts queued
        # done once the chosen D's requests have finished
        eventually(lambda: c.stats["role_switches_autobalance"] >= 1, 20, "the autobalance switch")
        assert c.stats["role_switches_autobalance"] == 1
        assert c.core is not None
        assert sorted(w.role for w in c.core.workers) == ["decode", "prefill", "prefill"]
        assert all(o.error is None for o in outs)
        assert [o.outputs[0].token_ids for o in outs] == reference(llm, batch, params)
        assert_cluster_idle(c)
