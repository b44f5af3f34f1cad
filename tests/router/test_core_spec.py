"""1P1D with speculation on D, through the RouterCore and in-process workers: the tokens of one
plain engine, and the request's speculation in its timeline record and D's stats."""

from __future__ import annotations

import asyncio
import time

import zmq

from factories import eventually_async
from pdserve import LLM, SamplingParams
from pdserve.config import WorkerConfig
from pdserve.launcher import WorkerSpec, await_ready, launch, stop
from pdserve.router.core import RouterCore
from pdserve.workers import messages as m

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[9, 4, 7, 2] * 6, list(range(100, 131))]


def test_speculating_d_gives_the_plain_tokens_and_reports_them(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_llama_path)).generate(PROMPTS, GREEDY)]
    ctx = zmq.Context.instance()
    args = {"model": str(tiny_llama_path), "threads": 1, "block_size": 4}
    cfg = WorkerConfig(transport="inproc", deadline_s=1.0)
    specs = [  # P is given the config too: a prefill worker never speculates
        WorkerSpec(role, f"{role[0].upper()}0", {**args, "speculative_config": SPEC}, cfg)
        for role in ("prefill", "decode")
    ]
    launched = [launch(s, ctx) for s in specs]
    try:
        for w in launched:
            await_ready(w, time.monotonic() + 120)

        async def run(core: RouterCore):  # type: ignore[no-untyped-def]
            outs = []
            for i, prompt in enumerate(PROMPTS):
                deltas = [d async for d in core.generate(f"s{i}", prompt, GREEDY)]
                outs.append([t for d in deltas for t in d.token_ids])

            def reported() -> dict | None:  # type: ignore[type-arg]
                table = core.worker_vitals()
                return table if table["D0"]["stats"].get("spec_steps") else None

            table = await eventually_async(reported, 10, "D's spec stats", interval_s=0.2)
            return outs, [core.timelines.spec.get(f"s{i}") for i in range(len(PROMPTS))], table

        async def with_core():  # type: ignore[no-untyped-def]
            core = RouterCore(
                [w.control for w in launched], deadline_s=1.0, ctx=ctx, stats_interval_s=0.2
            )
            await core.start(timeout_s=30)
            try:
                return await run(core)
            finally:
                await core.close()

        outs, spec, table = asyncio.run(with_core())
    finally:
        for w in launched:
            sock = ctx.socket(zmq.DEALER)
            sock.connect(w.control)
            sock.send(m.encode(m.Shutdown()))
            sock.close(1000)
            stop(w)
    assert outs == want
    assert spec[0] is not None and 0 < spec[0]["accepted_tokens"] <= spec[0]["draft_tokens"]
    assert table["D0"]["stats"]["spec_accepted_tokens"] > 0
    assert table["P0"]["stats"].get("spec_steps") is None  # P never speculated
