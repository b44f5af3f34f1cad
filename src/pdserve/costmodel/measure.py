"""The measurements behind a cost-model profile (profile.py): the grid of points (`Grid`: the
`FULL` and `QUICK` ones), an engine built for them, and the timed steps on it: a fresh or cached
prompt's one prefill step (`measure_prefill`) and decode steps of a batch admitted as a decode
worker receives it (`measure_decode`). Every point is the median of repeats; a point whose step
did not compute what was asked (a cache miss, a chunked prompt) is not recorded.
contention.py times the same steps under concurrency.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from pdserve.engine.engine import LLMEngine

BLOCK_SIZE = 16
REPEATS = 3


@dataclass(frozen=True)
class Grid:
    """The points to measure. Prompt lengths are capped at `max_prompt` when the engine is built."""

    prefill_new: tuple[int, ...]
    cached_fractions: tuple[float, ...]  # cached prefixes, as fractions of max_prompt
    cached_new_fractions: tuple[float, ...]  # new tokens after a cached prefix, likewise
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    decode_steps: int  # timed per (batch, context) and round, after one warm-up step
    transfer_tokens: tuple[int, ...]
    repeats: int = REPEATS
    # passes over the decode grid: a point's steps come from every pass, seconds apart, so a
    # slow or fast spell of a shared host (decode steps here drift 35-50 ms over seconds) is
    # not one point's whole sample
    decode_rounds: int = 1
    # the same for the fresh prefill points: each pass times every length once (rounds >=
    # repeats) or repeats / rounds times, so a slow spell lands on all lengths alike rather than
    # bending the fitted curve (one length at a time measured 128 tokens slower per token than
    # 256, and the fit dropped its attention term)
    prefill_rounds: int = 1


# Sized to take about a minute for SmolLM2-135M on one thread of this 2-core VM (two minutes
# when the machine is busy): the model has three terms per kind, so a handful of well-spread
# points fits it; the longest prompts cost most (2048 tokens: 5 s a run), so they are few.
FULL = Grid(
    prefill_new=(16, 64, 128, 256, 512, 1024, 2048),
    cached_fractions=(0.25, 0.75),
    cached_new_fractions=(1 / 128, 1 / 8),
    # every small batch: a decode worker alone runs at batch 1-4 most of the time, and the
    # step is not linear there (costmodel/model.py: one term per batch size)
    batches=(1, 2, 3, 4, 8, 16, 32),
    contexts=(128, 512, 2048),
    decode_steps=4,
    transfer_tokens=(16, 256, 1024, 2048),
    decode_rounds=3,
    prefill_rounds=3,
)
QUICK = Grid(
    prefill_new=(8, 32, 64, 128),
    cached_fractions=(0.25, 0.5),
    cached_new_fractions=(1 / 8, 1 / 4),
    batches=(1, 2, 4),
    contexts=(16, 64),
    decode_steps=3,
    transfer_tokens=(8, 64, 256),
)
QUICK_MAX_PROMPT = 128

PrefillSample = tuple[int, int, float]  # new, cached, seconds
DecodeSample = tuple[int, int, float]  # batch, context (summed), seconds


def log(msg: str) -> None:
    print(f"[profile] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- grid


def _round_block(n: float) -> int:
    return max(BLOCK_SIZE, int(n) // BLOCK_SIZE * BLOCK_SIZE)


def prefill_points(grid: Grid, max_prompt: int) -> list[int]:
    return sorted({n for n in grid.prefill_new if n <= max_prompt} | {max_prompt})


def cached_points(grid: Grid, max_prompt: int) -> list[tuple[int, int]]:
    """(cached, new) pairs: cached is whole blocks, as only whole blocks are ever cached."""
    points = {
        (_round_block(c * max_prompt), max(1, int(f * max_prompt)))
        for c in grid.cached_fractions
        for f in grid.cached_new_fractions
    }
    return sorted((c, n) for c, n in points if c + n <= max_prompt)


# --------------------------------------------------------------------------- engine


def build_engine(
    model: str | None, threads: int, max_prompt: int, grid: Grid, **engine_args: Any
) -> LLMEngine:
    from pdserve.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    settings: dict[str, Any] = {
        "threads": threads,
        "block_size": BLOCK_SIZE,
        "enable_prefix_caching": True,
        "max_num_seqs": max(grid.batches),
        "max_num_batched_tokens": max(max_prompt, max(grid.batches)),
    }
    settings.update(engine_args)
    if settings["max_num_batched_tokens"] < max_prompt:
        raise ValueError(
            f"max_num_batched_tokens={settings['max_num_batched_tokens']} < max_prompt="
            f"{max_prompt}: a prompt must be computed in one step to time it"
        )
    if not settings["enable_prefix_caching"]:
        raise ValueError("the profile needs enable_prefix_caching to measure cached prefills")
    return LLMEngine(EngineConfig.from_kwargs(model=model, **settings))


class Ids:
    """Fresh random token ids (clear of the low special/byte ids when the vocab allows)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        import numpy as np

        self.rng: np.random.Generator = np.random.default_rng(seed)
        self.low = 1000 if vocab > 2000 else 0
        self.high = vocab

    def __call__(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(self.low, self.high, size=n)]


def _greedy(max_tokens: int) -> Any:
    from pdserve.engine.request import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _median_of(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


# --------------------------------------------------------------------------- prefill


def prefill_step(engine: LLMEngine, prompt: list[int], cached: int) -> float:
    """Seconds of the step that computes `prompt` after its first `cached` tokens (checked)."""
    engine.add_request(prompt, _greedy(1))
    t0 = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - t0
    if engine.has_unfinished_requests() or len(outputs) != 1 or not outputs[0].finished:
        raise RuntimeError(f"a {len(prompt)}-token prompt did not prefill in one step")
    metrics = outputs[0].metrics
    got_cached = metrics.num_cached_tokens if metrics is not None else -1
    computed = engine.stats()["batch_tokens"]
    if got_cached != cached or computed != len(prompt) - cached:
        raise _CacheMiss(f"expected {cached} cached tokens, got {got_cached} ({computed} computed)")
    return seconds


class _CacheMiss(RuntimeError):
    pass


def measure_prefill(
    engine: LLMEngine, ids: Ids, grid: Grid, max_prompt: int
) -> list[PrefillSample]:
    samples: list[PrefillSample] = []
    points = prefill_points(grid, max_prompt)
    times: dict[int, list[float]] = {n: [] for n in points}
    rounds = max(1, grid.prefill_rounds)
    per_round = max(1, -(-grid.repeats // rounds))
    for r in range(rounds):
        log(f"prefill {', '.join(map(str, points))} new tokens (pass {r + 1} of {rounds})")
        for n in points:
            times[n] += [_fresh_prefill(engine, ids, n) for _ in range(per_round)]
    samples += [(n, 0, statistics.median(times[n])) for n in points]
    cached = cached_points(grid, max_prompt)
    if cached:
        prefix = ids(max(c for c, _ in cached))
        _prime(engine, prefix)
        for cached_n, new in cached:
            log(f"prefill {new} new tokens after {cached_n} cached")
            step = functools.partial(_cached_step, engine, ids, prefix, cached_n, new)
            samples.append((new, cached_n, _median_of(step, grid.repeats)))
    return samples


def _fresh_prefill(engine: LLMEngine, ids: Ids, n: int) -> float:
    return prefill_step(engine, ids(n), 0)


def _prime(engine: LLMEngine, prefix: list[int]) -> None:
    engine.add_request(prefix, _greedy(1))
    while engine.has_unfinished_requests():
        engine.step()


def _cached_step(engine: LLMEngine, ids: Ids, prefix: list[int], cached: int, new: int) -> float:
    prompt = prefix[:cached] + ids(new)
    try:
        return prefill_step(engine, prompt, cached)
    except _CacheMiss:  # the prefix was evicted: prime it again, once
        _prime(engine, prefix)
        return prefill_step(engine, prefix[:cached] + ids(new), cached)


# --------------------------------------------------------------------------- decode


def admit_decoding(
    engine: LLMEngine, ids: Ids, batch: int, context: int, max_tokens: int
) -> list[str] | None:
    """`batch` requests in decode with `context` tokens of KV each, as a decode worker admits
    them from a prefill worker; None (nothing left behind) when the KV does not fit."""
    rids: list[str] = []
    for i in range(batch):
        rid = f"profile-decode-{batch}-{context}-{i}"
        prompt = ids(context)
        if engine.reserve_kv(prompt, _greedy(max_tokens), rid, context) is None:
            for r in rids:
                engine.abort_request(r)
            return None
        engine.admit_prefilled(rid, ids(1), context)
        rids.append(rid)
    return rids


def _decode_fits(engine: LLMEngine, batch: int, context: int, max_tokens: int) -> bool:
    kv = engine.kv_manager
    per_request = kv.blocks_needed(context + max_tokens)
    return context + max_tokens < engine.max_model_len and batch * per_request <= kv.num_blocks


def decode_times(
    engine: LLMEngine, ids: Ids, batch: int, context: int, steps: int
) -> tuple[list[float], list[int]] | None:
    """Seconds of each of `steps` decode steps of `batch` requests, and each step's summed
    context; None when the batch does not fit."""
    max_tokens = steps + 3  # never finishes inside the timed window
    if not _decode_fits(engine, batch, context, max_tokens):
        return None
    rids = admit_decoding(engine, ids, batch, context, max_tokens)
    if rids is None:
        return None
    try:
        engine.step()  # warm-up: this batch shape's first step
        times, contexts = [], []
        requests = engine.scheduler.requests
        for _ in range(steps):
            contexts.append(sum(requests[r].num_tokens for r in rids))
            t0 = time.perf_counter()
            outputs = engine.step()
            times.append(time.perf_counter() - t0)
            if len(outputs) != batch:
                raise RuntimeError(f"a decode step produced {len(outputs)} tokens, not {batch}")
    finally:
        for rid in rids:
            engine.abort_request(rid)
    return times, contexts


def measure_decode(engine: LLMEngine, ids: Ids, grid: Grid, max_prompt: int) -> list[DecodeSample]:
    """One sample per (batch, context): the median of its steps over `grid.decode_rounds`
    passes of the whole grid."""
    points = [(b, c) for c in grid.contexts if c <= max_prompt for b in grid.batches]
    timed: dict[tuple[int, int], tuple[list[float], list[int]]] = {}
    skipped: set[tuple[int, int]] = set()
    for _ in range(max(1, grid.decode_rounds)):
        for batch, context in points:
            if (batch, context) in skipped:
                continue
            got = decode_times(engine, ids, batch, context, max(grid.decode_steps, REPEATS))
            if got is None:
                log(f"decode batch {batch} x {context} tokens: does not fit, skipped")
                skipped.add((batch, context))
                continue
            times, contexts = timed.setdefault((batch, context), ([], []))
            times += got[0]
            contexts += got[1]
    samples: list[DecodeSample] = []
    for (batch, context), (times, contexts) in timed.items():
        ms = statistics.median(times) * 1e3
        log(f"decode batch {batch} x {context} tokens: {ms:.1f} ms/step ({len(times)} steps)")
        samples.append((batch, round(statistics.mean(contexts)), statistics.median(times)))
    return samples


def warm_up(engine: LLMEngine, ids: Ids) -> None:
    """First calls allocate and pick kernels: keep them out of every timed point."""
    prefill_step(engine, ids(64), 0)
    decode_times(engine, ids, 2, 32, 2)
