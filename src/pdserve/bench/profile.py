"""`pdserve bench profile`: the CLI over `pdserve.costmodel.profile` (which measures this
machine's engine and fits its `CostModel`; see that module for what is measured and how)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pdserve import argtypes
from pdserve.costmodel.model import CostModel
from pdserve.costmodel.profile import profile_engine, profile_path

# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default: SmolLM2-135M")
    parser.add_argument(
        "--threads", type=argtypes.positive_int, default=1, help="torch threads (1)"
    )
    parser.add_argument(
        "--max-prompt",
        type=argtypes.positive_int,
        default=2048,
        help="longest prompt measured (2048)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="cost model JSON; default: the per-host cache path"
    )
    parser.add_argument("--samples-out", type=Path, default=None, help="raw samples as JSON")
    parser.add_argument("--quick", action="store_true", help="a few small points (seconds)")
    parser.add_argument(
        "--quantization",
        default="auto",
        help=(
            "projection weights: auto | none | int8 | w8g32 | w8a8 | gguf | gguf-a8 | gguf-a16 "
            "(auto: what serve runs)"
        ),
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache: auto | float32 | float16 | bfloat16 (auto)",
    )
    parser.add_argument(
        "--decode-matmul", default="auto", help="float32 decode matmuls: auto | tiles | torch"
    )
    parser.add_argument(
        "--prefill-format",
        default="auto",
        help="prompt rows' weights: auto | bf16x3 | bf16 | none (auto: what serve runs)",
    )
    parser.add_argument(
        "--contention",
        action="store_true",
        help="also time two workers sharing this host (two processes, ~20 s): the slowdown "
        "`pdserve sim --hardware cpu` applies while another worker is mid-step",
    )
    parser.add_argument(
        "--contention-seconds", type=float, default=3.0, help="per contention phase (3)"
    )


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.prefill_format import resolved
    from pdserve.engine.quantize import resolve_quantization

    # The file is named after what the engine runs (`auto` made concrete, as serve names it).
    args.quantization = resolve_quantization(args.quantization, args.model)
    args.prefill_format = resolved(args.prefill_format, args.quantization)
    result = profile_engine(
        args.model,
        args.threads,
        max_prompt=args.max_prompt,
        quick=args.quick,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        decode_matmul=args.decode_matmul,
        prefill_format=args.prefill_format,
    )
    about = result["about"]
    out = args.out or profile_path(
        args.model,
        args.threads,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        decode_matmul=args.decode_matmul,
        prefill_format=args.prefill_format,
    )
    result["model"].save(out, **about)
    if args.samples_out:
        args.samples_out.parent.mkdir(parents=True, exist_ok=True)
        raw = {k: result[k] for k in ("prefill", "decode", "transfer", "receive")}
        args.samples_out.write_text(json.dumps({**raw, "about": about}, indent=1) + "\n")
    print(render(result, out))
    if args.contention:
        print(_contention(args, out))
    return 0


def _contention(args: argparse.Namespace, out: Path) -> str:
    """The concurrent profile (`costmodel.contention.measure`), stored in the same file."""
    from pdserve.costmodel.contention import Shapes, measure

    if not args.contention_seconds > 0:
        raise ValueError("--contention-seconds must be > 0")
    prompt = min(256, args.max_prompt // 2)
    shapes = Shapes(prompt, 2 if args.quick else 4, prompt, args.contention_seconds)
    got = measure(args.model, args.threads, shapes, quantization=args.quantization)
    got["contention"].save_into(out)
    alone = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in got["alone"].items()}
    return (
        f"{got['contention'].note}\n(alone: prefill {shapes.prompt} tokens "
        f"{alone['prefill']:.1f} ms, decode {shapes.batch} x {shapes.context} "
        f"{alone['decode']:.1f} ms; {got['seconds']:.0f} s; stored in {out})"
    )


def render(result: dict[str, Any], out: Path) -> str:
    m: CostModel = result["model"]
    err, about = result["errors"], result["about"]
    (p0, p1, p2), (d0, d1, d2), (t0, t1) = m.prefill, m.decode, m.transfer
    r0, r1 = m.receive
    counts = about["samples"]
    per_batch = [
        f"| decode a({b}) | {a * 1e3:.2f} ms | step of a batch of {b} (per-batch term) |"
        for b, a in m.decode_by_batch
    ]
    if per_batch:
        per_batch.append(
            f"| decode dc | {m.decode_context * 1e3:.3f} ms/1k tokens | per 1k context tokens, "
            "with the per-batch terms (used for steps) |"
        )
    return "\n".join(
        [
            f"cost model: {about['model_name']} on {about['cpu']}, {about['threads']} thread(s), "
            f"profiled in {result['seconds']:.0f} s",
            "",
            "| term | coefficient | meaning |",
            "|---|---:|---|",
            f"| prefill p0 | {p0 * 1e3:.2f} ms | fixed cost of a prefill step |",
            f"| prefill p1 | {p1 * 1e3:.3f} ms/token | per new token (matmuls) |",
            f"| prefill p2 | {p2 * 1e3:.3f} ms/token/1k | per new token per 1k tokens attended |",
            f"| decode d0 | {d0 * 1e3:.2f} ms | fixed cost of a decode step (weights) |",
            f"| decode d1 | {d1 * 1e3:.3f} ms/request | per request in the batch |",
            f"| decode d2 | {d2 * 1e3:.3f} ms/1k tokens | per 1k context tokens (KV reads) |",
            *per_batch,
            f"| transfer t0 | {t0 * 1e3:.2f} ms | fixed cost of a KV transfer |",
            f"| transfer t1 | {t1 / 1e9:.2f} GB/s | KV bandwidth, loopback tcp |",
            f"| receive r0 | {r0 * 1e3:.2f} ms | D's fixed work per hand-off received |",
            f"| receive r1 | {r1 * 1e6:.2f} us/token | D's work per KV token received |",
            "",
            "| fit error (|pred - meas| / meas) | p50 | p90 | samples |",
            "|---|---:|---:|---:|",
            *(
                f"| {kind} | {_pct(err.get(f'{kind}_p50'))} | {_pct(err.get(f'{kind}_p90'))} "
                f"| {counts[kind]} |"
                for kind in ("prefill", "decode", "transfer", "receive")
                if kind in counts
            ),
            f"| decode, one linear fit (v2) | {_pct(err.get('decode_linear_p50'))} "
            f"| {_pct(err.get('decode_linear_p90'))} | {counts['decode']} |",
            "",
            f"wrote {out}",
        ]
    )


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"
