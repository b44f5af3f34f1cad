"""Adaptive PD end to end (issue 45): real workers (child processes, tcp) on the tiny model,
driven through LocalCluster. D prefills under a burst and not when idle (the planner's
`overflow` mode); threads move between P and D under load without losing a request or changing
a greedy output."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest

from factories import assert_cluster_idle, eventually
from pdserve import LLM, SamplingParams
from pdserve.cluster import LocalCluster
from pdserve.costmodel.model import CostModel
from pdserve.router.slo import SloPlanner
from pdserve.router.threads import ThreadPolicy

ENGINE = {"block_size": 16}
# roughly the tiny model's decode, and a prefill made slow (10 ms a token) so a 64-token prompt
# fills most of the TTFT SLO on paper: two queued on P break it
DECODE = (0.002, 1e-4, 0.0)
SLOW_PREFILL = CostModel((0.0, 0.01, 0.0), DECODE, (0.0005, 1e9))


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    return [[(seed * 131 + i * 17 + j) % 900 + 50 for j in range(length)] for i in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_llama_path):  # type: ignore[no-untyped-def]
    return LLM(str(tiny_llama_path), **ENGINE)


def reference(llm: LLM, batch: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def cluster(path, **core_args) -> LocalCluster:  # type: ignore[no-untyped-def]
    return LocalCluster(str(path), threads=1, engine_args=ENGINE, core_args=core_args)


@contextlib.contextmanager
def lent_to_d(  # type: ignore[no-untyped-def]
    path, planner: SloPlanner, first: list[list[int]], params: SamplingParams, d_delay_s: float
) -> Iterator[tuple[LocalCluster, Callable[[], dict], Future]]:
    """1P1D with threads moving on 2 cores; `first` submitted with D's steps slowed by
    `d_delay_s` (its decoding outlasts the prompts), and P, with nothing left to do, parked:
    D on both cores. Yields the cluster, each worker's threads, and `first`'s outputs."""
    policy = ThreadPolicy(cores=2, sustain_s=0.0, cooldown_s=0.0, park_after_s=0.0)
    with cluster(path, planner=planner, thread_policy=policy) as c:
        assert c.core is not None
        core = c.core
        threads = lambda: {w.worker_id: w.stats.threads for w in core.workers}  # noqa: E731
        c.set_fault("D0", "slow", count=-1, delay_s=d_delay_s)
        _, pending = c.submit(first, params)
        eventually(lambda: threads() == {"P0": 1, "D0": 2}, 30, "D to get every core")
        yield c, threads, pending


def test_d_prefills_under_a_burst_and_not_when_idle(tiny_llama_path, llm) -> None:  # type: ignore[no-untyped-def]
    planner = SloPlanner(
        SLOW_PREFILL, slo_ttft_s=0.9, slo_tpot_s=5.0, admission=False, mode="overflow"
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone, burst = prompts(1, 64, seed=1), prompts(4, 64, seed=2)
    with cluster(tiny_llama_path, planner=planner) as c:
        assert c.core is not None
        idle = c.generate(alone, params, timeout_s=60)
        assert c.stats["route_remote"] == 1 and c.stats["route_local"] == 0
        c.set_fault("P0", "slow", count=2, delay_s=0.5)  # the burst's first tokens come late
        outs = c.generate(burst, params, timeout_s=60)
        assert [o.outputs[0].token_ids for o in idle + outs] == reference(
            llm, alone + burst, params
        )
        assert c.stats["route_local"] >= 1 and c.stats["route_remote"] >= 2
        # which side prefilled each request: the route (and its workers) per request
        first = c.core.prediction(idle[0].request_id)
        assert first is not None and first["route"] == "remote"
        assert first["workers"] == ["P0", "D0"]
        routes = [c.core.prediction(o.request_id) for o in outs]
        local = [r for r in routes if r is not None and r["route"] == "local"]
        assert local and all(r["workers"] == ["D0"] for r in local)
        assert_cluster_idle(c)


def test_threads_move_under_load_and_lose_nothing(tiny_llama_path, llm) -> None:  # type: ignore[no-untyped-def]
    planner = SloPlanner(SLOW_PREFILL, slo_ttft_s=5.0, admission=False, mode="overflow")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    first, second = prompts(3, 48, seed=3), prompts(3, 48, seed=4)
    with lent_to_d(tiny_llama_path, planner, first, params, 0.08) as (c, _, pending):
        # new prompts reach P (made slow, so they stay queued a while): the split comes back
        c.set_fault("P0", "slow", count=2, delay_s=0.5)
        _, later = c.submit(second, params)
        eventually(lambda: c.stats["thread_moves_to_prefill"] >= 1, 30, "a move back to P")
        c.set_fault("D0", "none")
        outs = pending.result(timeout=120) + later.result(timeout=120)
        assert all(o.error is None for o in outs)
        assert [o.outputs[0].token_ids for o in outs] == reference(llm, first + second, params)
        assert c.stats["thread_moves_to_decode"] >= 1
        assert c.worker_stats()["D0"]["thread_changes"] >= 1
        assert_cluster_idle(c)


def test_d_holds_its_steps_for_ps_prompts_within_tpot_and_loses_nothing(  # type: ignore[no-untyped-def]
    tiny_llama_path, llm
) -> None:
    # a TPOT SLO with room to spare: while prompts wait on P, D holds its steps (SetThreads(0))
    # and P prefills on both cores; D resumes once P is done (router/threads.py `hold_decode`)
    planner = SloPlanner(
        SLOW_PREFILL, slo_ttft_s=5.0, slo_tpot_s=5.0, admission=False, mode="overflow"
    )
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    first, second = prompts(2, 48, seed=5), prompts(3, 48, seed=6)
    with lent_to_d(tiny_llama_path, planner, first, params, 0.05) as (c, threads, pending):
        c.set_fault("P0", "slow", count=4, delay_s=0.5)  # the new prompts stay queued a while
        _, later = c.submit(second, params)
        eventually(lambda: threads() == {"P0": 2, "D0": 0}, 30, "D to hold, P on both cores")
        c.set_fault("D0", "none")
        outs = pending.result(timeout=120) + later.result(timeout=120)
        assert all(o.error is None for o in outs)
        assert [o.outputs[0].token_ids for o in outs] == reference(llm, first + second, params)
        d = c.worker_stats()["D0"]
        assert d["step_holds"] >= 1 and d["step_resumes"] >= 1
        assert c.stats["thread_moves_to_prefill"] >= 1
        assert_cluster_idle(c)
