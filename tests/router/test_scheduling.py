"""RouterCore's SLO scheduling against fake workers with scripted timings (fake_workers.py):
admission, conditional disaggregation, prefix-aware routing and session affinity, role switching
under load, and the autobalancer driving it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import zmq.asyncio
from fake_workers import BLOCK, FakeWorker, start_fakes

from factories import eventually_async
from pdserve import SamplingParams
from pdserve.costmodel.model import CostModel
from pdserve.metrics.prometheus import Metrics
from pdserve.router.balancer import Autobalancer
from pdserve.router.core import RequestError, RouterCore
from pdserve.router.slo import SloPlanner

# 0.2 ms per prompt token; a decode step of 5 ms + 0.5 ms per request in the batch
MODEL = CostModel((0.0, 2e-4, 0.0), (0.005, 0.0005, 0.0), (0.0, 1e12))


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


async def run(
    roles: dict[str, str],
    body: Callable[[RouterCore, list[FakeWorker]], Awaitable[Any]],
    **core_kw: Any,
) -> Any:
    ctx = zmq.asyncio.Context()
    fakes = await start_fakes(ctx, MODEL, roles)
    core = RouterCore([f.endpoint for f in fakes], ctx=ctx, stats_interval_s=0.2, **core_kw)
    await core.start(timeout_s=5)
    try:
        return await body(core, fakes)
    finally:
        await core.close()
        for f in fakes:
            await f.close()
        ctx.term()


async def collect(core: RouterCore, rid: str, prompt: list[int], n: int, **kw: Any) -> list[int]:
    return [t async for d in core.generate(rid, prompt, params(n), **kw) for t in d.token_ids]


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i) % 30000 + 100 for i in range(n)]


def test_admission_rejects_at_once_and_admitted_requests_meet_the_ttft_slo() -> None:
    planner = SloPlanner(MODEL, slo_ttft_s=0.5, slo_tpot_s=0.1)
    metrics = Metrics(slo_ttft_s=0.5, slo_tpot_s=0.1)

    async def body(core: RouterCore, fakes: list[FakeWorker]) -> None:
        # 12 prompts of 1000 tokens = 0.2 s of prefill each on one P: only ~2-3 fit in 0.5 s
        async def one(i: int) -> tuple[str, float, float | None]:
            t0 = time.monotonic()
            try:
                first = None
                async for _d in core.generate(f"r{i}", prompt(1000, i), params(4)):
                    first = first or time.monotonic() - t0
                return "ok", time.monotonic() - t0, first
            except RequestError as e:
                assert e.status == 429 and e.retry_after_s and e.retry_after_s >= 1
                assert e.code == "slo_ttft"
                return "rejected", time.monotonic() - t0, None

        results = await asyncio.gather(*(one(i) for i in range(12)))
        ok = [r for r in results if r[0] == "ok"]
        rejected = [r for r in results if r[0] == "rejected"]
        assert ok and rejected, results
        assert max(r[1] for r in rejected) < 0.05  # refused before any prefill is spent
        assert all(r[2] is not None and r[2] <= 0.5 * 1.2 for r in ok), ok
        assert core.counters["rejected_slo_ttft"] == len(rejected)
        text = metrics.render().decode()
        assert f'pdserve_request_rejections_total{{code="slo_ttft"}} {float(len(rejected))}' in text
        rid = next(f"r{i}" for i, r in enumerate(results) if r[0] == "ok")
        pred = core.prediction(rid)
        assert pred is not None and pred["ttft_s"] > 0 and pred["actual_ttft_s"] > 0
        assert "pdserve_prediction_error_ratio_bucket" in text

    asyncio.run(run({"P0": "prefill", "D0": "decode"}, body, planner=planner, metrics=metrics))


def test_without_admission_everything_is_served() -> None:
    planner = SloPlanner(MODEL, slo_ttft_s=0.5, slo_tpot_s=0.1, admission=False)

    async def body(core: RouterCore, fakes: list[FakeWorker]) -> None:
        outs = await asyncio.gather(*(collect(core, f"r{i}", prompt(1000, i), 3) for i in range(8)))
        assert all(len(o) == 3 for o in outs)
        assert not any(k.startswith("rejected") for k in core.counters)

    asyncio.run(run({"P0": "prefill", "D0": "decode"}, body, planner=planner))


def test_conditional_runs_short_idle_prompts_on_d_and_long_ones_on_p_under_decode_load() -> None:
    planner = SloPlanner(MODEL)

    async def body(core: RouterCore, fakes: list[FakeWorker]) -> None:
        p0, d0 = fakes
        assert await collect(core, "short", prompt(50), 4)
        assert core.timeline("short") is not None
        routes = [
            e["event"] for e in core.timeline("short") or [] if e["event"].startswith("route")
        ]
        assert routes == ["route: local"] and "Generate" in d0.handled
        # keep D busy with 6 long answers, then a long prompt goes through P
        busy = [asyncio.create_task(collect(core, f"b{i}", prompt(40, i), 200)) for i in range(6)]
        streaming = lambda: sum(f.first_at is not None for f in core.flights.values()) == 6  # noqa: E731
        await eventually_async(streaming, 10, "6 busy answers decoding on D")
        assert len(await collect(core, "long", prompt(1500, 9), 4)) == 4
        assert "Prefill" in p0.handled
        pred = core.prediction("long")
        assert pred is not None and pred["route"] == "remote"
        await asyncio.gather(*busy)
        assert core.counters["route_local"] >= 1 and core.counters["route_remote"] >= 1

    asyncio.run(run({"P0": "prefill", "D0": "decode"}, body, planner=planner))


def test_always_mode_sends_every_request_through_p() -> None:
    planner = SloPlanner(MODEL, mode="always")

    async def body(core: RouterCore, fakes: list[FakeWorker]) -> None:
        for i in range(3):
            await collect(core, f"r{i}", prompt(30, i), 3)
        assert core.counters["route_remote"] == 3 and core.counters["route_local"] == 0

    asyncio.run(run({"P0": "prefill", "D0": "decode"}, body, planner=planner))


async def _indexed(core: RouterCore, prompt_ids: list[int], worker_id: str) -> None:
    """Wait until the worker's KVEvents for `prompt_ids` have reached the router's index."""

    def cached() -> bool:
        return (
            core.prefix.match(prompt_ids, BLOCK, [worker_id]).get(worker_id, 0)
            >= len(prompt_ids) // BLOCK * BLOCK
        )

    await eventually_async(cached, 5, f"{worker_id}'s KVEvents")


def test_prefix_routing_sends_a_follow_up_to_the_worker_holding_its_prefix() -> None:
    planner = SloPlanner(MODEL, mode="always")

    async def body(core: RouterCore, fakes: list[FakeWorker]) -> None:
        first = prompt(640, 1)
        await collect(core, "t1", first, 2)
        holder = core.prediction("t1")["workers"][0]  # type: ignore[index]
        await _indexed(core, first, holder)
        await collect(core, "t2", first + prompt(64, 2), 2)
        pred = core.prediction("t2")
        assert pred is not None and pred["workers"][0] == holder
        assert pred["cached_prefill_tokens"] == 640
        fake = next(f for f in fakes if f.worker_id == holder)
        assert fake.prefills[-1] == ("t2.1", 64)  # only the new tokens were computed

    roles = {"P0": "prefill", "P1": "prefill", "D0": "decode", "D1": "decode"}
    asyncio.run(run(roles, body, planner=planner))


def test_without_prefix_routing_the_cache_is_not_consulted() -> None:
    planner = SloPlanner(MODEL, mode="always")

    async def body(core: RouterCore, fakes: list[FakeWorker]) -> None:
        first = prompt(640, 1)
        await collect(core, "t1", first, 2)
        holder = core.prediction("t1")["workers"][0]  # type: ignore[index]
        await _indexed(core, first, holder)  # the index knows: routing just does not ask it
        await collect(core, "t2", first + prompt(64, 2), 2)
        pred = core.prediction("t2")
        assert pred is not None and pred["cached_prefill_tokens"] == 0

    roles = {"P0": "prefill", "P1": "prefill", "D0": "decode", "D1": "decode"}
    asyncio.run(run(roles, body, planner=planner, prefix_routing=False))


def test_session_affinity_holds_when_the_index_has_not_heard_from_the_worker() -> None:
    planner = SloPlanner(MODEL)

    async def body(core: RouterCore, fakes: list[FakeWorker]) -> None:
        turn1 = prompt(320, 3)
        out = await collect(core, "s1", turn1, 5, session="conv-1")
        keeper = core.sessions["conv-1"][0]
        core.prefix.drop(keeper)  # as if its events were lost
        turn2 = turn1 + out + prompt(40, 4)
        cached = core.routing.cached(turn2, "conv-1", {w.worker_id: w for w in core.workers})
        assert cached[keeper] == 320 // 16 * 16

    asyncio.run(run({"P0": "prefill", "D0": "decode", "D1": "decode"}, body, planner=planner))


def test_role_switch_under_load_drains_switches_and_loses_nothing() -> None:
    planner = SloPlanner(MODEL)

    async def body(core: RouterCore, fakes: list[FakeWorker]) -> None:
        load = [asyncio.create_task(collect(core, f"r{i}", prompt(200, i), 30)) for i in range(8)]
        await eventually_async(lambda: any(f.sent for f in core.flights.values()), 10, "load")
        row = await core.set_role("D1", "prefill")
        assert row["role"] == "prefill" and not row["draining"]
        assert next(f for f in fakes if f.worker_id == "D1").role == "prefill"
        more = [asyncio.create_task(collect(core, f"m{i}", prompt(200, i), 10)) for i in range(4)]
        outs = await asyncio.gather(*load, *more)
        assert [len(o) for o in outs] == [30] * 8 + [10] * 4  # every request, whole
        assert core.counters["role_switches_admin"] == 1
        with pytest.raises(RequestError) as e:
            await core.set_role("nope", "decode")
        assert e.value.status == 404

    roles = {"P0": "prefill", "D0": "decode", "D1": "decode"}
    asyncio.run(run(roles, body, planner=planner))


def test_autobalance_moves_a_decode_worker_to_prefill_when_prompts_pile_up() -> None:
    planner = SloPlanner(MODEL, mode="always", slo_ttft_s=0.3, admission=False)
    auto = Autobalancer(high=0.7, low=0.3, sustain_s=0.5, cooldown_s=60.0)

    async def body(core: RouterCore, fakes: list[FakeWorker]) -> None:
        # long prompts, one-token answers: P is the bottleneck, the two D's idle
        load = [asyncio.create_task(collect(core, f"r{i}", prompt(1500, i), 2)) for i in range(16)]
        outs = await asyncio.gather(*load)
        assert all(len(o) == 2 for o in outs)
        roles = sorted(w.role for w in core.workers)
        assert roles == ["decode", "prefill", "prefill"], roles
        assert core.counters["role_switches_autobalance"] == 1

    roles = {"P0": "prefill", "D0": "decode", "D1": "decode"}
    asyncio.run(run(roles, body, planner=planner, autobalancer=auto, autobalance_interval_s=0.1))
