"""RouterCore against real (in-process) workers: parity, abort, retry with resume, timelines."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import zmq

from factories import eventually_async
from pdserve import LLM, SamplingParams
from pdserve.config import WorkerConfig
from pdserve.engine import step_log
from pdserve.launcher import WorkerSpec, await_ready, launch, stop
from pdserve.router.core import RequestError, RouterCore
from pdserve.workers import messages as m

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
INPROC = WorkerConfig(transport="inproc", deadline_s=1.0)
PROMPTS = [[5, 6, 7], list(range(100, 160)), [9] * 17]


@pytest.fixture(scope="module")
def workers(tiny_llama_path):  # type: ignore[no-untyped-def]
    ctx = zmq.Context.instance()
    args = {"model": str(tiny_llama_path), "threads": 1, "block_size": 4}
    specs = [
        WorkerSpec(
            "prefill", "P0", args, WorkerConfig(transport="inproc", deadline_s=1.0, lease_s=2.0)
        ),
        WorkerSpec(
            "decode",
            "D0",
            {**args, "block_size": 16},
            WorkerConfig(transport="inproc", deadline_s=1.0),
        ),
    ]
    launched = [launch(s, ctx) for s in specs]
    for w in launched:
        await_ready(w, time.monotonic() + 120)
    yield ctx, launched
    for w in launched:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(w.control)
        sock.send(m.encode(m.Shutdown()))
        sock.close(1000)
        stop(w)


@pytest.fixture(scope="module")
def reference(tiny_llama_path) -> list[list[int]]:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_llama_path))
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


async def _with_core(workers, fn):  # type: ignore[no-untyped-def]
    ctx, launched = workers
    core = RouterCore([w.control for w in launched], deadline_s=1.0, ctx=ctx, stats_interval_s=0.2)
    await core.start(timeout_s=30)
    try:
        return await fn(core)
    finally:
        await core.close()


async def _collect(core: RouterCore, rid: str, prompt: list[int], params: SamplingParams):  # type: ignore[no-untyped-def]
    deltas = [d async for d in core.generate(rid, prompt, params)]
    return [t for d in deltas for t in d.token_ids], deltas[-1].finish_reason


async def _idle(core: RouterCore) -> list[dict]:  # type: ignore[type-arg]
    """The worker table once every worker reports no running request and no used block (the
    stats arrive every 0.2 s here)."""

    def idle() -> list[dict] | None:  # type: ignore[type-arg]
        table = core.worker_table()
        return table if all(r["kv_blocks_used"] == 0 and r["running"] == 0 for r in table) else None

    return await eventually_async(idle, 10, "every worker idle", interval_s=0.2)


def test_concurrent_requests_match_llm_and_leave_no_blocks(workers, reference) -> None:  # type: ignore[no-untyped-def]
    async def run(core: RouterCore):  # type: ignore[no-untyped-def]
        outs = await asyncio.gather(
            *[_collect(core, f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
        )
        table = await _idle(core)
        return outs, table, core.timeline("r1")

    outs, table, timeline = asyncio.run(_with_core(workers, run))
    assert [o[0] for o in outs] == reference
    assert all(o[1] == "length" for o in outs)
    assert {r["role"] for r in table} == {"prefill", "decode"}
    assert all(r["healthy"] and r["kv_blocks_used"] == 0 for r in table)
    assert all(r["quantization"] == "none" for r in table)  # as the workers report it
    names = [e["event"] for e in timeline]
    order = ["arrive", "dispatch", "prefill_start", "prefill_end", "first_token", "finish"]
    assert [n for n in names if n in order] == order
    assert "transfer_end" in names and all(e["t_ms"] >= 0 for e in timeline)


def test_abandoning_a_stream_aborts_it_everywhere(workers) -> None:  # type: ignore[no-untyped-def]
    async def run(core: RouterCore):  # type: ignore[no-untyped-def]
        params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
        gen = core.generate("long", [5] * 20, params)
        async for _ in gen:
            break  # the client went away after its first token
        await gen.aclose()
        table = await _idle(core)
        return table, core.timeline("long")

    table, timeline = asyncio.run(_with_core(workers, run))
    assert all(r["kv_blocks_used"] == 0 and r["running"] == 0 for r in table)
    # the router ends it at once; a worker may still report a stage it finished meanwhile
    assert "aborted" in [e["event"] for e in timeline]


def test_retry_resumes_after_streamed_tokens_without_duplicates(workers, reference) -> None:  # type: ignore[no-untyped-def]
    async def run(core: RouterCore):  # type: ignore[no-untyped-def]
        p0 = next(w for w in core.workers if w.role == "prefill")
        core.links.send(p0, m.SetFault("corrupt", 1))
        out = await _collect(core, "retry", PROMPTS[1], GREEDY)
        return out, core.counters["retries"], await _idle(core)

    (tokens, finish), retries, table = asyncio.run(_with_core(workers, run))
    assert retries == 1 and finish == "length"
    assert tokens == reference[1]  # no token lost or repeated across the retry
    assert all(r["kv_blocks_used"] == 0 for r in table)


def test_bad_request_is_a_400_and_unknown_timeline_is_none(workers) -> None:  # type: ignore[no-untyped-def]
    async def run(core: RouterCore):  # type: ignore[no-untyped-def]
        with pytest.raises(RequestError) as err:
            await _collect(core, "big", [5] * 5000, GREEDY)
        return err.value, core.timeline("nope")

    err, timeline = asyncio.run(_with_core(workers, run))
    assert err.status == 400 and "shorten" in err.message
    assert timeline is None


def test_overload_is_refused_at_once_with_retry_after(workers) -> None:  # type: ignore[no-untyped-def]
    async def run(core: RouterCore):  # type: ignore[no-untyped-def]
        core.config = dataclasses.replace(core.config, max_inflight=1)
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        first = core.generate("busy", [5] * 10, params)
        await first.__anext__()  # in flight now
        with pytest.raises(RequestError) as err:
            await _collect(core, "extra", [5] * 10, GREEDY)
        await first.aclose()
        return err.value, core.counters["requests_rejected"], await _idle(core)

    err, rejected, table = asyncio.run(_with_core(workers, run))
    assert (err.status, err.code, err.retry_after_s) == (429, "overloaded", 1)
    assert rejected == 1 and all(r["kv_blocks_used"] == 0 for r in table)


def test_step_logs_are_the_workers_steps_since_a_time(workers) -> None:  # type: ignore[no-untyped-def]
    """GET /admin/steps' source: each worker's engine steps begun after `since`, P's a prompt
    chunk of the request's length, D's its decodes; none before a request, none after a later
    `since`."""
    prompt = list(range(300, 337))  # no other test's: no cached prefix on P

    async def run(core: RouterCore):  # type: ignore[no-untyped-def]
        await _idle(core)
        since = time.monotonic()
        before = await core.links.step_logs.collect(core.workers, since)
        await _collect(core, "steps", prompt, GREEDY)
        during = await core.links.step_logs.collect(core.workers, since)
        after = await core.links.step_logs.collect(core.workers, time.monotonic())
        return before, during, after

    before, during, after = asyncio.run(_with_core(workers, run))
    assert before["workers"] == {"P0": [], "D0": []} and before["missing"] == []
    p = step_log.from_wire(during["workers"]["P0"], during["threads"]["P0"])
    d = step_log.from_wire(during["workers"]["D0"], during["threads"]["D0"])
    assert {s.threads for s in p + d} == {1}  # each worker's one thread, recorded
    assert sum(n for s in p for n, _ in s.chunks) == len(prompt)
    assert not any(s.decodes for s in p)
    assert sum(s.decodes for s in d) == GREEDY.max_tokens - 1  # the first token is P's
    assert all(s.start >= during["since"] and s.seconds > 0 for s in p + d)
    assert after["workers"] == {"P0": [], "D0": []}
