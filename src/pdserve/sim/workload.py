"""Simulated request streams: the bench workloads' lengths with Poisson or gamma arrivals, or a
trace replayed from CSV.

The bench workloads (`bench/workloads.py`) are used as they are: `synthetic`, `mixed`,
`shifting` and `multiturn` (placeholder answers: a simulation has no text) yield the prompts'
token ids and max_tokens; the simulator only adds arrival times. `rag` needs a tokenizer and
the BM25 index to build real prompts; here it is its shape: a shared 58-token system prompt and
chat header (what the real rag prompts share, 3 whole 16-token blocks cached) then
question + passages of random ids, lengths around `input_len`, answers around `output_len`.

Arrivals: Poisson (exponential gaps, mean 1 / rate) or gamma with a coefficient of variation
`cv` (cv = 1 is Poisson; > 1 burstier), as DistServe's simulator offers; `--bench-arrivals`
takes the very times `pdserve bench serve` sends at for the same rate and seed. The turns of a
multiturn conversation share their first turn's arrival process; later turns are sent when the
previous one ends (the simulator holds them). With `pdserve sim --concurrency` the arrival times
are ignored: the closed loop of the load generator sends the requests (sim/closedloop.py), think
times included. A turn's answer is the
placeholder its next turn's prompt carries (`answers_in_next_turns`): the workers sample those
tokens, so the worker that decoded a turn holds the next turn's history in its prefix cache.

A trace (`--trace`: Mooncake jsonl, Azure csv, or a CSV with `arrival_s`, `input_tokens`,
`output_tokens`: workloads/traces.py) gives the arrivals and lengths, windowed and scaled as
`bench replay` does it, and the prompts' shared blocks where its hash_ids repeat.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from pdserve.sim.cluster import SimRequest
from pdserve.workloads import streams as bw
from pdserve.workloads.spec import arrival_gaps
from pdserve.workloads.traces import Scaling, Trace, prompt_ids, read_trace

SIM_WORKLOADS = ("synthetic", "rag", "mixed", "shifting", "multiturn")
RAG_SHARED_PREFIX = 58  # tokens of the rag workload's system prompt + chat header


def arrivals(n: int, rate: float, seed: int, cv: float = 1.0, bench: bool = False) -> list[float]:
    """`n` arrival times starting at 0: gamma gaps with mean 1 / rate and the given cv.

    `bench`: the times `pdserve bench serve --rate R --burstiness 1/cv^2 --seed S` sends at
    (its own gaps, `workloads.spec.arrival_gaps`), counted from its first request. A sweep of
    20 requests at 0.6 req/s sent them over 44 s where the simulator's own draw spread them
    over 32 s: predicting a measured point needs the measured arrivals, not another draw."""
    if not rate > 0 or not np.isfinite(rate):
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if not cv > 0:
        raise ValueError(f"arrival cv must be > 0, got {cv}")
    if n < 1:
        raise ValueError(f"num_requests must be >= 1, got {n}")
    shape = 1.0 / (cv * cv)
    if bench:
        gaps = np.asarray(arrival_gaps(rate, shape, n, seed))
        return [float(t) for t in np.cumsum(gaps) - gaps[0]]
    rng = np.random.default_rng(seed + 7919)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


class RagShape:
    name = "rag"

    def __init__(
        self, num_requests: int, input_len: int, output_len: int, spread: float, seed: int
    ) -> None:
        rng = np.random.default_rng(seed)
        shared = bw._random_ids(np.random.default_rng(1), RAG_SHARED_PREFIX)
        ins = bw.sample_lengths(rng, max(input_len - RAG_SHARED_PREFIX, 1), spread, num_requests)
        outs = bw.sample_lengths(rng, output_len, spread, num_requests)
        self._items = [
            bw.RequestItem(shared + bw._random_ids(rng, n), o, conversation=i)
            for i, (n, o) in enumerate(zip(ins, outs, strict=True))
        ]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._items)


def make_items(args: argparse.Namespace) -> list[bw.RequestItem]:
    if args.workload == "rag":
        return list(
            RagShape(args.num_requests, args.input_len, args.output_len, args.len_spread, args.seed)
        )
    if args.workload not in SIM_WORKLOADS:
        raise ValueError(f"unknown workload {args.workload!r}; choose one of {SIM_WORKLOADS}")
    from pdserve.workloads.spec import LoadSpec, workload_defaults

    given = vars(args)
    extra = {k: given[k] for k in workload_defaults() if k in given}
    spec = LoadSpec(
        url="simulated",
        num_requests=args.num_requests,
        rate=1.0,  # unused: the simulator draws its own arrivals
        workload=args.workload,
        input_len=args.input_len,
        output_len=args.output_len,
        len_spread=args.len_spread,
        turns=getattr(args, "turns", 3),
        seed=args.seed,
        workload_args={**extra, "multiturn_answers": "placeholder"},
    )
    return list(bw.make_workload(spec))


def requests_from_items(items: list[bw.RequestItem], times: list[float]) -> list[SimRequest]:
    """Attach arrival times; every turn of a conversation after the first waits for it."""
    multi = any(it.turn > 0 for it in items)
    answers = answers_in_next_turns(items) if multi else {}
    return [
        SimRequest(
            f"r{i}",
            t,
            list(it.prompt),
            it.max_tokens,
            conversation=it.conversation if multi else -1,
            turn=it.turn,
            phase=it.phase,
            answer=answers.get(i, ()),
        )
        for i, (it, t) in enumerate(zip(items, times, strict=False))
    ]


def answers_in_next_turns(items: list[bw.RequestItem]) -> dict[int, tuple[int, ...]]:
    """Item index -> the answer tokens the conversation's next turn carries in its prompt
    (the workload's placeholder answers): what that turn's workers sample, so a worker's
    cached KV of turn t is the history of turn t + 1, as in a real conversation."""
    turns = {(it.conversation, it.turn): it for it in items}
    out = {}
    for i, it in enumerate(items):
        nxt = turns.get((it.conversation, it.turn + 1))
        n = len(it.prompt)
        if nxt is not None and nxt.prompt[:n] == it.prompt:
            out[i] = tuple(nxt.prompt[n : n + it.max_tokens])
    return out


def make_requests(args: argparse.Namespace) -> list[SimRequest]:
    if getattr(args, "trace", None):
        return trace_requests(read_trace(Path(args.trace), scaling_from_args(args)), args.seed)
    items = make_items(args)
    bench = getattr(args, "bench_arrivals", False)
    times = arrivals(len(items), args.rate, args.seed, args.arrival_cv, bench)
    return requests_from_items(items, times)


def scaling_from_args(args: argparse.Namespace) -> Scaling:
    """The trace window and scaling flags (`pdserve sim` and `bench replay` spell them alike)."""
    return Scaling(
        getattr(args, "limit", None),
        getattr(args, "start_ms", 0.0),
        getattr(args, "length_scale", 1.0),
        getattr(args, "time_scale", 1.0),
    )


def trace_requests(trace: Trace, seed: int = 0) -> list[SimRequest]:
    """The trace's requests with prompts of token ids whose blocks repeat where its hash_ids
    repeat (`traces.prompt_ids`, the blocks `bench replay --prompt-format ids` sends), so the
    workers' prefix caches and the router's prefix index see the trace's reuse."""
    return [
        SimRequest(f"r{i}", r.arrival_s, prompt_ids(r, i, seed), r.output_len)
        for i, r in enumerate(trace.requests)
    ]


def load_trace(path: Path, seed: int = 0) -> list[SimRequest]:
    """Every request of a trace file (traces.py: Mooncake, Azure or a plain CSV), unscaled."""
    return trace_requests(read_trace(path, Scaling()), seed)
