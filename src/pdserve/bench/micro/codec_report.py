"""`pdserve bench codec`'s report: the markdown page (quality and speed tables) and the JSON."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.bench.harness import report
from pdserve.bench.micro.codec_quality import CodecQuality
from pdserve.bench.micro.codec_speed import CodecSpeed

CRC_WARN_GBS = 2.0


@dataclass
class Report(report.ReportHead):
    model: dict[str, Any]
    settings: dict[str, Any]
    quality: list[CodecQuality]
    speed: list[CodecSpeed]
    crc32_gbs: float
    prompt_lens: list[int] = field(default_factory=list)


def render_markdown(rep: Report) -> str:
    return "\n".join(
        [
            "# KV codec benchmark",
            "",
            *_header(rep),
            "",
            "## Quality (greedy decoding after the prompt KV's wire round trip)",
            "",
            *_quality_table(rep),
            "",
            "## Speed",
            "",
            *_speed_table(rep),
            "",
            *_method_notes(rep),
            "",
        ]
    )


def _header(rep: Report) -> list[str]:
    m, model, s, lens = rep.machine, rep.model, rep.settings, rep.prompt_lens
    threads_note = "torch's default" if s["threads"] is None else "--threads"
    return [
        *report.head_lines(rep),
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['threads']} torch threads "
        f"({threads_note}), torch {m['torch']}, python {m['python']}, load average (1 min) "
        f"at start/end {report.load_span(m)}",
        f"- model: {model['name']} ({model['dtype']}, {model['layers']} layers, "
        f"{model['kv_heads']} KV heads x head_dim {model['head_dim']})",
        f"- prompts: {len(lens)} ({min(lens)}-{max(lens)} tokens, mean "
        f"{statistics.fmean(lens):.0f}), {s['max_tokens']} greedy tokens each, one batch, "
        f"prefix caching off, KL over decode steps 1-{s['kl_steps']}",
    ]


def _quality_table(rep: Report) -> list[str]:
    none = next((q for q in rep.quality if q.codec == "none"), None)
    rows = [
        "| codec | wire bytes/token | saved vs none | token match | identical outputs "
        f"| mean KL (nats), steps 1-{rep.settings['kl_steps']} | max KL |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for q in rep.quality:
        saved = f"{1 - q.bytes_per_token / none.bytes_per_token:.1%}" if none else "—"
        rows.append(
            f"| {q.codec} | {q.bytes_per_token:,.0f} | {saved} | {q.token_match:.2%} | "
            f"{q.identical_prompts}/{len(rep.prompt_lens)} | {q.kl_mean:.2e} | {q.kl_max:.2e} |"
        )
    return rows


def _speed_table(rep: Report) -> list[str]:
    model, s = rep.model, rep.settings
    crc_note = (
        " (under ~2 GB/s: the checksum is a bottleneck)" if rep.crc32_gbs < CRC_WARN_GBS else ""
    )
    rows = [
        f"Random KV of {s['speed_tokens']} tokens x {model['layers']} layers x K,V "
        f"({model['kv_heads']} heads, head_dim {model['head_dim']}, {model['dtype']}); GB/s of "
        f"uncompressed KV, median of {s['repeats']} runs.",
        "",
        "| codec | encoded/raw | encode GB/s | decode GB/s | frame encode+decode GB/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rep.speed:
        rows.append(
            f"| {r.codec} | {r.ratio:.3f} | {r.encode_gbs:.2f} | {r.decode_gbs:.2f} | "
            f"{r.frame_gbs:.2f} |"
        )
    rows += [
        "",
        "`none` encode of a contiguous CPU tensor is a zero-copy view: its rate is call overhead. "
        "Frame encode+decode = `encode_frame` (CRC-32 included) + the receiver joining the parts "
        "+ `decode_frame` (CRC-32 again) + `layers()`.",
        "",
        f"zlib.crc32 on {s['crc_mb']} MB: {rep.crc32_gbs:.2f} GB/s{crc_note}.",
    ]
    return rows


def _method_notes(rep: Report) -> list[str]:
    return [
        "Method: baseline keeps the KV in the cache; each codec run round-trips every prompt's "
        "KV through `encode_frame` / `decode_frame` right after its prefill step and decodes "
        "on. Token match: free-running greedy tokens vs the baseline, position-wise (token 0 "
        "precedes the transfer). KL: KL(p_baseline || p_codec) of the full next-token "
        "distribution, teacher-forced on the baseline's tokens so only the KV differs. "
        "Details: `pdserve.bench.micro.codec_bench`.",
    ]


def report_json(rep: Report) -> dict[str, Any]:
    data = asdict(rep)
    for q, raw in zip(rep.quality, data["quality"], strict=True):
        raw["bytes_per_token"] = q.bytes_per_token
    return data
