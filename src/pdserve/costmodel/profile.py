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

Every point is the median of `repeats` (>= 3) timings, after one warm-up prefill and decode;
the fresh prompt lengths and the decode points are timed in interleaved passes (`Grid`).
The model is fitted with `CostModel.fit_relative`: samples span 50 ms to seconds, and a plain
least-squares fit would serve the long ones and miss the short ones by 2x.
`quick=True` uses a few small points (seconds, for tests on tiny models).

`load_or_profile` is what a server calls at start-up: the saved model for this host, model and
thread count (`profile_path`) if there is a valid one, else a fresh profile, saved.
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve import hostinfo
from pdserve.config import cost_kv_cache_dtype
from pdserve.costmodel.measure import (
    BLOCK_SIZE,
    FULL,
    QUICK,
    QUICK_MAX_PROMPT,
    Ids,
    build_engine,
    log,
    measure_decode,
    measure_prefill,
    warm_up,
)
from pdserve.costmodel.model import CostModel, default_path
from pdserve.costmodel.profile_transfer import kv_bytes_per_token, measure_transfer, transfer_errors

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine

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
    log(f"loading the engine ({threads} thread{'s' * (threads > 1)})")
    engine = build_engine(model, threads, max_prompt, grid, **engine_args)
    max_prompt = _cap_prompt(engine, max_prompt)
    ids = Ids(engine.arch.vocab_size)
    warm_up(engine, ids)
    prefill = measure_prefill(engine, ids, grid, max_prompt)
    decode = measure_decode(engine, ids, grid, max_prompt)
    transfer, receive = measure_transfer(engine, grid.transfer_tokens, grid.repeats, log)
    fitted = CostModel.fit_relative(prefill, decode, transfer, receive)
    errors = {**fitted.errors(prefill, decode), **transfer_errors(fitted, transfer, receive)}
    linear = CostModel.fit_relative(prefill, decode, by_batch=False).errors(prefill, decode)
    errors |= {"decode_linear_p50": linear["decode_p50"], "decode_linear_p90": linear["decode_p90"]}
    seconds = time.perf_counter() - start
    samples = (prefill, decode, transfer, receive)
    about = _about(engine, threads, quick, max_prompt, samples, errors)
    about["profile_seconds"] = round(seconds, 1)
    log(f"done in {seconds:.1f} s")
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
        log(
            f"load average {load:.2f} on {cores} cores: other work shares the CPU, so the "
            "timings (and the cost model) will be slower and noisier than on a quiet machine"
        )


def _cap_prompt(engine: LLMEngine, max_prompt: int) -> int:
    """Prompts (and decode contexts) must leave room in the model's context for a few tokens."""
    cap = engine.max_model_len - 2 * BLOCK_SIZE
    if max_prompt > cap:
        log(f"the model's context is {engine.max_model_len} tokens: max_prompt {max_prompt}->{cap}")
        return cap
    return max_prompt


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
        log(f"cost model from {path}")
        return cached
    log(f"no valid cost model at {path}: profiling (about a minute on the default model)")
    result = profile_engine(model, threads, quick=quick, **engine_args)
    result["model"].save(path, **result["about"])
    log(f"wrote {path}")
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
        log(f"ignoring {path}: {e}")
        return None
    about = CostModel.load_about(path)
    measured = about.get("threads")
    if measured is not None and measured != threads:
        log(f"ignoring {path}: measured with {measured} threads, not {threads}")
        return None
    if about.get("quantization", "none") != quantization:
        log(f"ignoring {path}: measured with quantization {about.get('quantization')}")
        return None
    if about.get("kv_cache_dtype", "auto") != kv_cache_dtype:
        log(f"ignoring {path}: measured with KV cache dtype {about.get('kv_cache_dtype')}")
        return None
    # Files from before the tile kernel measured torch's GEMM.
    if about.get("decode_matmul", "torch") != decode_matmul:
        log(f"ignoring {path}: measured with decode matmul {about.get('decode_matmul', 'torch')}")
        return None
    return loaded
