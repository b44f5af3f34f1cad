"""Measure this machine's engine and fit its `CostModel` (`pdserve bench profile` is the CLI).

Everything is measured on the real engine in this process, with `threads` torch threads:

  * prefill (new, cached, s): the one `engine.step()` that computes a whole prompt (the token
    budget is >= the longest prompt, so no chunking), sampling included. Prompts are fresh
    random ids, so they never hit the prefix cache by accident. For the cached points a priming
    prompt is run first; each timed prompt then shares its first `cached` tokens (whole blocks)
    and adds `new` fresh ones. The request's `num_cached_tokens` and the step's batch size are
    checked, so a sample is recorded only if the step really computed exactly `new` tokens.
  * decode (batch, context, s): `batch` requests of `L` prompt tokens are put straight into
    decode the way a decode worker receives them from a prefill worker (`reserve_kv` +
    `admit_prefilled`): their KV blocks are distinct, as with real requests, and no prefill is
    paid for (a 32 x 2048-token prefill would take minutes). The KV content is whatever the
    blocks hold; attention costs the same whatever the values. After a warm-up step, each decode
    step is timed; context = the keys attended, summed over the batch (prompt + generated).
    Combinations whose KV does not fit the cache or the model's context are skipped.
  * transfer (bytes, s) and receive (tokens, s): one request's KV over a loopback ZeroMQ pair,
    the wire and D's own receive apart (costmodel/profile_transfer.py).

Every point is the median of `repeats` (>= 3) timings, after one warm-up prefill and decode.
The model is fitted with `CostModel.fit_relative`: samples span 50 ms to seconds, and a plain
least-squares fit would serve the long ones and miss the short ones by 2x.
`quick=True` uses a few small points (seconds, for tests on tiny models).

`load_or_profile` is what a server calls at start-up: the saved model for this host, model and
thread count (`profile_path`) if there is a valid one, else a fresh profile, saved.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve import hostinfo
from pdserve.config import cost_kv_cache_dtype
from pdserve.costmodel.model import CostModel, default_path
from pdserve.costmodel.profile_transfer import kv_bytes_per_token, measure_transfer, transfer_errors

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


def _log(msg: str) -> None:
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


class _Ids:
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


def _prefill_step(engine: LLMEngine, prompt: list[int], cached: int) -> float:
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
    engine: LLMEngine, ids: _Ids, grid: Grid, max_prompt: int
) -> list[PrefillSample]:
    samples: list[PrefillSample] = []
    for n in prefill_points(grid, max_prompt):
        _log(f"prefill {n} new tokens")
        s = _median_of(functools.partial(_fresh_prefill, engine, ids, n), grid.repeats)
        samples.append((n, 0, s))
    points = cached_points(grid, max_prompt)
    if points:
        prefix = ids(max(c for c, _ in points))
        _prime(engine, prefix)
        for cached, new in points:
            _log(f"prefill {new} new tokens after {cached} cached")
            step = functools.partial(_cached_step, engine, ids, prefix, cached, new)
            s = _median_of(step, grid.repeats)
            samples.append((new, cached, s))
    return samples


def _fresh_prefill(engine: LLMEngine, ids: _Ids, n: int) -> float:
    return _prefill_step(engine, ids(n), 0)


def _prime(engine: LLMEngine, prefix: list[int]) -> None:
    engine.add_request(prefix, _greedy(1))
    while engine.has_unfinished_requests():
        engine.step()


def _cached_step(engine: LLMEngine, ids: _Ids, prefix: list[int], cached: int, new: int) -> float:
    prompt = prefix[:cached] + ids(new)
    try:
        return _prefill_step(engine, prompt, cached)
    except _CacheMiss:  # the prefix was evicted: prime it again, once
        _prime(engine, prefix)
        return _prefill_step(engine, prefix[:cached] + ids(new), cached)


# --------------------------------------------------------------------------- decode


def _admit_decoding(
    engine: LLMEngine, ids: _Ids, batch: int, context: int, max_tokens: int
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
    engine: LLMEngine, ids: _Ids, batch: int, context: int, steps: int
) -> tuple[list[float], list[int]] | None:
    """Seconds of each of `steps` decode steps of `batch` requests, and each step's summed
    context; None when the batch does not fit."""
    max_tokens = steps + 3  # never finishes inside the timed window
    if not _decode_fits(engine, batch, context, max_tokens):
        return None
    rids = _admit_decoding(engine, ids, batch, context, max_tokens)
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


def measure_decode(engine: LLMEngine, ids: _Ids, grid: Grid, max_prompt: int) -> list[DecodeSample]:
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
                _log(f"decode batch {batch} x {context} tokens: does not fit, skipped")
                skipped.add((batch, context))
                continue
            times, contexts = timed.setdefault((batch, context), ([], []))
            times += got[0]
            contexts += got[1]
    samples: list[DecodeSample] = []
    for (batch, context), (times, contexts) in timed.items():
        ms = statistics.median(times) * 1e3
        _log(f"decode batch {batch} x {context} tokens: {ms:.1f} ms/step ({len(times)} steps)")
        samples.append((batch, round(statistics.mean(contexts)), statistics.median(times)))
    return samples


# --------------------------------------------------------------------------- profile


def profile_engine(
    model: str | None,
    threads: int,
    *,
    max_prompt: int = 2048,
    quick: bool = False,
    **engine_args: Any,
) -> dict[str, Any]:
    """Measure the engine, fit a `CostModel`; returns a dict with

    `prefill`, `decode`, `transfer`, `receive`: the samples ((new, cached, s), (batch,
    context, s), (bytes, s), (tokens, s)); `model`: the fitted CostModel; `errors`: its relative
    errors on the samples (`CostModel.errors` plus `transfer_p50`, `receive_p50`, and
    `decode_linear_p50/p90`: the one-line decode fit without per-batch terms, for comparison);
    `seconds`: wall time; `about`: what `save` records.
    """
    import torch

    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if max_prompt < 2 * BLOCK_SIZE:
        raise ValueError(f"max_prompt must be >= {2 * BLOCK_SIZE}, got {max_prompt}")
    start = time.perf_counter()
    torch.set_num_threads(threads)
    _warn_if_busy(threads)
    grid = QUICK if quick else FULL
    max_prompt = min(max_prompt, QUICK_MAX_PROMPT) if quick else max_prompt
    _log(f"loading the engine ({threads} thread{'s' * (threads > 1)})")
    engine = build_engine(model, threads, max_prompt, grid, **engine_args)
    max_prompt = _cap_prompt(engine, max_prompt)
    ids = _Ids(engine.arch.vocab_size)
    _warm_up(engine, ids)
    prefill = measure_prefill(engine, ids, grid, max_prompt)
    decode = measure_decode(engine, ids, grid, max_prompt)
    transfer, receive = measure_transfer(engine, grid.transfer_tokens, grid.repeats, _log)
    fitted = CostModel.fit_relative(prefill, decode, transfer, receive)
    errors = {**fitted.errors(prefill, decode), **transfer_errors(fitted, transfer, receive)}
    linear = CostModel.fit_relative(prefill, decode, by_batch=False).errors(prefill, decode)
    errors |= {"decode_linear_p50": linear["decode_p50"], "decode_linear_p90": linear["decode_p90"]}
    seconds = time.perf_counter() - start
    samples = (prefill, decode, transfer, receive)
    about = _about(engine, threads, quick, max_prompt, samples, errors)
    about["profile_seconds"] = round(seconds, 1)
    _log(f"done in {seconds:.1f} s")
    return {
        "prefill": prefill,
        "decode": decode,
        "transfer": transfer,
        "receive": receive,
        "model": fitted,
        "errors": errors,
        "seconds": seconds,
        "about": about,
    }


def _warn_if_busy(threads: int) -> None:
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load + threads > cores + 0.5:
        _log(
            f"load average {load:.2f} on {cores} cores: other work shares the CPU, so the "
            "timings (and the cost model) will be slower and noisier than on a quiet machine"
        )


def _cap_prompt(engine: LLMEngine, max_prompt: int) -> int:
    """Prompts (and decode contexts) must leave room in the model's context for a few tokens."""
    cap = engine.max_model_len - 2 * BLOCK_SIZE
    if max_prompt > cap:
        _log(
            f"the model's context is {engine.max_model_len} tokens: max_prompt {max_prompt}->{cap}"
        )
        return cap
    return max_prompt


def _warm_up(engine: LLMEngine, ids: _Ids) -> None:
    """First calls allocate and pick kernels: keep them out of every timed point."""
    _prefill_step(engine, ids(64), 0)
    decode_times(engine, ids, 2, 32, 2)


def _about(
    engine: LLMEngine,
    threads: int,
    quick: bool,
    max_prompt: int,
    samples: tuple[Sequence[object], ...],
    errors: dict[str, float],
) -> dict[str, Any]:
    import torch

    return {
        "host": platform.node(),
        "cpu": hostinfo.cpu_model(),
        "cores": os.cpu_count(),
        "threads": threads,
        "model": str(engine.source.path),
        "model_name": engine.arch.name or engine.source.path.name,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "quantization": engine.quantization,
        "kv_cache_dtype": cost_kv_cache_dtype(
            engine.config.cache_config.kv_cache_dtype,
            engine.quantization,
            str(engine.dtype).removeprefix("torch."),
        ),
        "decode_matmul": engine.decode_matmul,  # as resolved: tiles | torch
        "kv_bytes_per_token": kv_bytes_per_token(engine),
        "torch": torch.__version__,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "quick": quick,
        "max_prompt": max_prompt,
        "samples": {
            k: len(v)
            for k, v in zip(("prefill", "decode", "transfer", "receive"), samples, strict=True)
        },
        "errors": {k: round(v, 4) for k, v in errors.items()},
        "load_average": list(os.getloadavg()),
    }


# --------------------------------------------------------------------------- cache


def model_path(model: str | None) -> str:
    """The model file or folder `model` names (None: the default model)."""
    from pdserve.engine.loader import resolve_model

    return str(resolve_model(model).path)


def profile_path(
    model: str | None,
    threads: int,
    *,
    quantization: str = "auto",
    kv_cache_dtype: str = "auto",
    decode_matmul: str = "auto",
    prefill_format: str = "auto",
    dtype: str = "float32",
    device: str = "cpu",
) -> Path:
    """This host's cost-model file for an engine with these settings: the one name that
    `pdserve serve`, `bench profile`, `plan` and `sim` read and write (each used to resolve the
    settings its own way, and `sim --hardware cpu` looked for a file serve never wrote).

    The settings are made concrete as the engine makes them (`auto` quantization for this model,
    the KV dtype the cache really holds, the prefill format this CPU runs), so `auto` and the
    setting it resolves to name one file."""
    from pdserve.engine.prefill_format import resolved
    from pdserve.engine.quantize import resolve_quantization

    quant = resolve_quantization(quantization, model, device, dtype)
    return default_path(
        model_path(model),
        threads,
        quantization=quant,
        kv_cache_dtype=cost_kv_cache_dtype(kv_cache_dtype, quant, dtype),
        decode_matmul=decode_matmul,
        prefill_format=resolved(prefill_format, quant, dtype),
    )


def missing_profile(path: Path, threads: int = 1) -> str:
    """What to say when a command needs this host's cost model and finds none."""
    return (
        f"no cost model at {path}: profile this machine with `pdserve bench profile --threads "
        f"{threads}` (about a minute; `pdserve serve` with a feature that needs one also writes "
        "it), or pass --cost-model PATH"
    )


def load_or_profile(
    model: str | None,
    threads: int,
    path: Path | None = None,
    *,
    quick: bool = False,
    **engine_args: Any,
) -> CostModel:
    """The saved cost model for this host, model and thread count, or a fresh profile (saved).

    A file is reused when it loads and was measured with the same thread count; anything else
    (missing, corrupt, another version) is profiled again and overwritten.
    """
    from pdserve.engine.prefill_format import resolved
    from pdserve.engine.quantize import resolve_quantization

    dtype = str(engine_args.get("dtype", "float32"))
    device = str(engine_args.get("device", "cpu"))
    quantization = resolve_quantization(
        str(engine_args.get("quantization", "auto")), model, device, dtype
    )
    engine_args["quantization"] = quantization
    kv = cost_kv_cache_dtype(str(engine_args.get("kv_cache_dtype", "auto")), quantization, dtype)
    mm = str(engine_args.get("decode_matmul", "auto"))
    pf = resolved(str(engine_args.get("prefill_format", "auto")), quantization, dtype)
    engine_args["prefill_format"] = pf
    path = path or profile_path(
        model, threads, quantization=quantization, kv_cache_dtype=kv, decode_matmul=mm,
        prefill_format=pf, dtype=dtype, device=device,
    )  # fmt: skip
    cached = _load_valid(path, threads, quantization, kv, _resolved_matmul(mm, quantization, dtype))
    if cached is not None:
        _log(f"cost model from {path}")
        return cached
    _log(f"no valid cost model at {path}: profiling (about a minute on the default model)")
    result = profile_engine(model, threads, quick=quick, **engine_args)
    result["model"].save(path, **result["about"])
    _log(f"wrote {path}")
    return result["model"]  # type: ignore[no-any-return]


def _resolved_matmul(name: str, quantization: str, dtype: str) -> str:
    """What `--decode-matmul name` is for a CPU engine with these settings (tiles | torch)."""
    import torch

    from pdserve.engine.quantize import decode_matmul

    return decode_matmul(name, quantization, torch.device("cpu"), getattr(torch, dtype))


def _load_valid(
    path: Path,
    threads: int,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
    decode_matmul: str = "torch",
) -> CostModel | None:
    if not path.is_file():
        return None
    try:
        loaded = CostModel.load(path)
    except ValueError as e:
        _log(f"ignoring {path}: {e}")
        return None
    about = CostModel.load_about(path)
    measured = about.get("threads")
    if measured is not None and measured != threads:
        _log(f"ignoring {path}: measured with {measured} threads, not {threads}")
        return None
    if about.get("quantization", "none") != quantization:
        _log(f"ignoring {path}: measured with quantization {about.get('quantization')}")
        return None
    if about.get("kv_cache_dtype", "auto") != kv_cache_dtype:
        _log(f"ignoring {path}: measured with KV cache dtype {about.get('kv_cache_dtype')}")
        return None
    # Files from before the tile kernel measured torch's GEMM.
    if about.get("decode_matmul", "torch") != decode_matmul:
        _log(f"ignoring {path}: measured with decode matmul {about.get('decode_matmul', 'torch')}")
        return None
    return loaded
