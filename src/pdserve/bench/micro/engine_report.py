"""`pdserve bench engine`'s targets (issue 12: met, missed or not run) and its report: the
markdown page and the JSON."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pdserve.bench.harness import report
from pdserve.bench.micro.engine_results import (
    BANDWIDTH_MIB,
    MATMUL_N,
    NOISY_SPREAD,
    WARMUP_STEPS,
    Report,
    Row,
)

TARGET_PREFILL_LEN = 512
TARGET_PREFILL_MFU = 0.50
TARGET_DECODE_MBU = 0.70
TARGET_BATCH_SCALING = (8, 5.0)  # decode B=8 >= 5x the tokens/s of B=1 (issue 12)
TARGET_CONTEXT = 1024  # decode targets at this context
TARGET_CONTEXT_GROWTH = (2048, 128, 1.3)  # step at 2048 <= 1.3x the step at 128 (B=1)
TARGET_PREFILL_VS_CPP = 1.5
TARGET_ATTENTION_VS_READ = 2.0  # attention at B=1 C=1024 <= 2x the time to read its KV


# --------------------------------------------------------------------------- targets


def _find(rows: list[Row], phase: str, size: int, context: int | None = None) -> Row | None:
    return next(
        (
            r
            for r in rows
            if r.phase == phase and r.size == size and context in (None, r.nominal_context)
        ),
        None,
    )


def evaluate_targets(rows: list[Row]) -> list[report.Target]:
    out: list[report.Target] = []
    for q in dict.fromkeys(r.quantization for r in rows):
        out += [
            report.Target(f"[{q}] {t.name}", t.measured, t.met)
            for t in _targets_of([r for r in rows if r.quantization == q])
        ]
    return out


def _targets_of(rows: list[Row]) -> list[report.Target]:
    decodes = [r for r in rows if r.phase == "decode"]
    low = min((r.nominal_context for r in decodes), default=0)
    prefill = _find(rows, "prefill", TARGET_PREFILL_LEN)
    d1 = _find(rows, "decode", 1, TARGET_CONTEXT)
    b, factor = TARGET_BATCH_SCALING
    long_c, short_c, growth = TARGET_CONTEXT_GROWTH
    ratios = [r.ratio for r in rows if r.ratio is not None]
    cpp_prefill = [r.cpp_ratio for r in rows if r.phase == "prefill" and r.cpp_ratio is not None]
    return [
        report.Target(
            f"prefill MFU at {TARGET_PREFILL_LEN} tokens >= {TARGET_PREFILL_MFU:.0%}",
            f"{prefill.utilization:.1%}" if prefill else "not run",
            prefill.utilization >= TARGET_PREFILL_MFU if prefill else None,
        ),
        report.Target(
            f"decode B=1 C={TARGET_CONTEXT} MBU >= {TARGET_DECODE_MBU:.0%}",
            f"{d1.utilization:.1%}" if d1 else "not run",
            d1.utilization >= TARGET_DECODE_MBU if d1 else None,
        ),
        _ratio_target(
            f"decode B=1 C={TARGET_CONTEXT} faster per token than llama.cpp",
            d1.cpp_ratio if d1 else None,
            1.0,
            strict=True,
        ),
        _ratio_target(
            f"prefill tokens/s >= {TARGET_PREFILL_VS_CPP:g}x llama.cpp (every length)",
            min(cpp_prefill) if cpp_prefill else None,
            TARGET_PREFILL_VS_CPP,
        ),
        _scaling_target(_find(rows, "decode", 1, low), _find(rows, "decode", b, low), b, factor),
        _growth_target(_find(rows, "decode", 1, long_c), _find(rows, "decode", 1, short_c), growth),
        _attention_target(d1),
        report.Target(
            "never slower than transformers (every pdserve/HF >= 1)",
            f"min {min(ratios):.2f}x" if ratios else "not run",
            min(ratios) >= 1.0 if ratios else None,
        ),
    ]


def _ratio_target(
    name: str, ratio: float | None, need: float, strict: bool = False
) -> report.Target:
    if ratio is None:
        return report.Target(name, "not run", None)
    met = ratio > need if strict else ratio >= need
    return report.Target(name, f"{ratio:.2f}x", met)


def _scaling_target(d1: Row | None, db: Row | None, b: int, factor: float) -> report.Target:
    name = f"decode B={b} tokens/s >= {factor:g}x B=1"
    if d1 is None or db is None:
        return report.Target(name, "not run", None)
    gain = db.tokens_per_s / d1.tokens_per_s
    return report.Target(f"{name} (C={d1.nominal_context})", f"{gain:.2f}x", gain >= factor)


def _growth_target(long: Row | None, short: Row | None, limit: float) -> report.Target:
    long_c, short_c, _ = TARGET_CONTEXT_GROWTH
    name = f"decode B=1 step at C={long_c} <= {limit:g}x the step at C={short_c}"
    if long is None or short is None:
        return report.Target(name, "not run", None)
    growth = long.seconds / short.seconds
    return report.Target(name, f"{growth:.2f}x", growth <= limit)


def _attention_target(d1: Row | None) -> report.Target:
    name = (
        f"attention at B=1 C={TARGET_CONTEXT} <= {TARGET_ATTENTION_VS_READ:g}x the time to "
        "read its KV"
    )
    if d1 is None or d1.attention_share is None or not d1.kv_read_s:
        return report.Target(name, "not run", None)
    times = d1.attention_share * d1.seconds / d1.kv_read_s
    return report.Target(name, f"{times:.2f}x", times <= TARGET_ATTENTION_VS_READ)


# --------------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def render_markdown(rep: Report) -> str:
    lines = [
        "# pdserve engine benchmark",
        "",
        *_header(rep),
        "",
        *_results_table(rep.rows),
        *_noise_note(rep.rows),
        "",
        "## Targets",
        "",
        *report.targets_table(rep.targets),
        "",
        "MFU = model FLOPs / time / fp32 matmul FLOP/s (int8 rows too); MBU = (weight bytes as "
        "stored + KV bytes) / step time / read GB/s; attn = share of the decode step inside "
        "paged attention (a separate timed run); HF decode is a greedy forward loop with its KV "
        "cache (not `generate`); llama.cpp decodes one sequence. Formulas: "
        "`pdserve.bench.micro.engine_bench`.",
        "",
    ]
    return "\n".join(lines)


def _header(rep: Report) -> list[str]:
    m, roof, model, st = rep.machine, rep.roofline, rep.model, rep.settings
    weights = ", ".join(f"{q} {b / 1e6:.0f} MB" for q, b in model["weight_bytes_per_step"].items())
    return [
        *report.head_lines(rep),
        f"- model: {model['name']} ({model['source']}, {model['dtype']}, {model['layers']} "
        f"layers, {model['matmul_params'] / 1e6:.1f} M matmul params; weights read per decode "
        f"step: {weights})",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads used, "
        f"torch {m['torch']}, transformers {m['transformers']}, "
        f"llama-cpp-python {m.get('llama_cpp') or 'not installed'}, "
        f"load average (1 min) at start/end {report.load_span(m)}",
        f"- roofline (torch, {m['threads']} threads, {BANDWIDTH_MIB} MiB buffers): matmul "
        f"{roof.matmul_gflops:.1f} GFLOP/s ({MATMUL_N}x{MATMUL_N} fp32); read "
        f"{roof.read_gbs:.1f} GB/s (bytes read / time, best of torch.sum "
        f"{roof.sum_gbs:.1f} and matvec {roof.matvec_gbs:.1f}: the MBU reference); copy "
        f"{roof.copy_gbs:.1f} GB/s ((read + written) / time)",
        f"- decode: requests admitted with C tokens of random KV, {WARMUP_STEPS} warm-up + "
        f"{st['decode_steps']} timed steps; every number is a median of {st['repeats']} rounds "
        "(every side and point once a round, in turn); pdserve/HF and pdserve/llama.cpp are "
        "medians of the rounds' ratios",
        *(f"- {note}" for note in rep.notes),
    ]


def _noise_note(rows: list[Row]) -> list[str]:
    noisy = [
        f"{r.quantization} {r.label} ({r.spread:.1f}x)" for r in rows if r.spread > NOISY_SPREAD
    ]
    above = [f"{r.quantization} {r.label}" for r in rows if r.utilization > 1.0]
    notes = []
    if noisy:
        notes.append(f"Noisy (slowest/fastest repeat > {NOISY_SPREAD}x): {', '.join(noisy)}.")
    if above:
        notes.append(
            f"Above 100% of the roofline: {', '.join(above)}; the roofline was measured while "
            "the machine was busier than during that row, or the data fit in cache."
        )
    return ["", *notes] if notes else []


def _results_table(rows: list[Row]) -> list[str]:
    out = [
        "| run | weights | pdserve tok/s | pdserve ms | HF tok/s | llama.cpp tok/s | "
        "pdserve/HF | pdserve/llama.cpp | MFU / MBU | attn |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kind = "MFU" if r.phase == "prefill" else "MBU"
        out.append(
            f"| {r.label} | {r.quantization} | {r.tokens_per_s:.1f} | {r.seconds * 1e3:.1f} | "
            f"{_fmt(r.hf_tokens_per_s, '.1f')} | {_fmt(r.cpp_tokens_per_s, '.1f')} | "
            f"{_fmt(r.ratio, '.2f')} | {_fmt(r.cpp_ratio, '.2f')} | "
            f"{kind} {r.utilization:.1%} | {_fmt(r.attention_share, '.0%')} |"
        )
    return out


def report_json(rep: Report) -> dict[str, Any]:
    data = asdict(rep)
    for row, raw in zip(rep.rows, data["rows"], strict=True):
        raw.update(label=row.label, ratio=row.ratio, cpp_ratio=row.cpp_ratio, spread=row.spread)
    for target, raw in zip(rep.targets, data["targets"], strict=True):
        raw["status"] = target.status
    return data
