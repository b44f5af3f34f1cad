"""A dead D's request resumes on a surviving D that reads the KV pool itself
(router/pool_feedback.py), through the real RouterCore and fake workers that name their pools
(no pool behind them: what matters here is the route the router picks from its pool index)."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq.asyncio
from fake_workers import FakeWorker
from test_scheduling import MODEL, collect, prompt

from factories import eventually_async
from pdserve.router.core import RouterCore
from pdserve.router.slo import SloPlanner


async def _recover(
    pools: dict[str, list[str]], booked: list[float] | None = None, **core_kw: Any
) -> tuple[RouterCore, dict[str, FakeWorker], str]:
    """1 P + 2 D named `pools`; a request streams 40 tokens, its D goes down after 5. Returns
    the core (closed), the fakes and the surviving D's id; `booked`: gets the prefill seconds
    the planner booked on the survivor for the recovery."""
    ctx = zmq.asyncio.Context()
    roles = {"P0": "prefill", "D0": "decode", "D1": "decode"}
    fakes = {w: FakeWorker(w, r, ctx, MODEL, kv_pools=pools.get(w, [])) for w, r in roles.items()}
    core = RouterCore(
        [f.endpoint for f in fakes.values()], ctx=ctx, stats_interval_s=0.2, **core_kw
    )
    await core.start(timeout_s=5)
    try:
        task = asyncio.create_task(collect(core, "r1", prompt(67), 40))
        flight = await eventually_async(lambda: core.flights.get("r1"), what="the flight")
        await eventually_async(lambda: len(flight.sent) >= 5, what="5 tokens streamed")
        assert flight.pair is not None and flight.pair[1] is not None
        dead = flight.pair[1]
        core.worker_down(dead, "test")
        if booked is not None:
            survivor_load = next(p for p in flight.pair if p is not None).load
            booked.append(survivor_load.jobs["r1"].prefill_s)
        assert len(await asyncio.wait_for(task, 20)) == 40  # nothing lost, nothing repeated
        survivor = "D1" if dead.worker_id == "D0" else "D0"
        return core, fakes, survivor
    finally:
        await core.close()
        for f in fakes.values():
            await f.close()
        ctx.term()


def test_a_surviving_d_whose_pool_holds_the_context_resumes_it_without_p() -> None:
    core, fakes, survivor = asyncio.run(_recover({w: ["redis"] for w in ("P0", "D0", "D1")}))
    # the index learnt the prompt's 4 blocks (64 of 67 + 5 tokens) from the workers' KVEvents
    assert fakes[survivor].handled.count("Generate") == 1
    assert "ExpectKV" not in fakes[survivor].handled
    assert fakes["P0"].handled.count("Prefill") == 1  # the first attempt's only
    routes = [(e, w) for e, w, _ in core.raw_timeline("r1") or [] if e.startswith("route")]
    assert routes[-1] == ("route: pool_resume", survivor)
    assert core.counters["route_pool_resume"] == 1


def test_without_a_pool_on_the_surviving_d_a_p_prefills_the_recovery() -> None:
    core, fakes, survivor = asyncio.run(_recover({"P0": ["redis"]}))
    assert "Generate" not in fakes[survivor].handled
    assert fakes[survivor].handled.count("ExpectKV") == 1
    assert fakes["P0"].handled.count("Prefill") == 2
    assert core.counters["route_pool_resume"] == 0


def test_the_planner_books_a_pool_resume_as_loading_the_pooled_context() -> None:
    planner = SloPlanner(MODEL, kv_bytes_per_token=1000, mode="always")  # P, then D
    booked: list[float] = []
    pools = {w: ["redis"] for w in ("P0", "D0", "D1")}
    asyncio.run(_recover(pools, booked, planner=planner))
    # 72 tokens of context, 64 of them in the pool: ~8 computed, not 72
    (prefill,) = booked
    assert prefill < MODEL.prefill_s(20, 64) < MODEL.prefill_s(72)
