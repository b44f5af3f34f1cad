"""The markdown page and the JSON of `pdserve bench transfer` (`transfer_results.Report`; the
measuring is `transfer_bench`'s)."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import asdict
from typing import Any

from pdserve.bench.harness import report
from pdserve.bench.transfer.transfer_results import (
    CRC_MB,
    NOISY_SPREAD,
    SHM_MB,
    TARGET_EXPOSED,
    TARGET_RATIO,
    BaselineRow,
    Report,
    ThroughputRow,
)


def machine_info() -> dict[str, Any]:
    import zmq

    return report.machine_info(
        1, pyzmq=zmq.__version__, libzmq=zmq.zmq_version(), git_head=report.git_head()
    )


def command_line(args: argparse.Namespace) -> str:
    """The invoking command if it was `pdserve bench transfer ...`, else an equivalent one with
    every setting spelled out (`python -m pdserve.bench.transfer.transfer_bench ...`, `main`)."""
    invoked = report.invoked_as("transfer")
    if invoked is not None:
        return invoked
    parts = shlex.split(getattr(args, "prog", None) or "pdserve bench transfer")
    if args.model:
        parts += ["--model", str(args.model)]
    parts += ["--sizes", ",".join(map(str, args.sizes))]
    parts += ["--transports", ",".join(args.transports), "--codecs", ",".join(args.codecs)]
    parts += ["--repeats", str(args.repeats)]
    parts += ["--ttft-lens", ",".join(map(str, args.ttft_lens))]
    parts += ["--ttft-requests", str(args.ttft_requests)]
    parts += ["--ttft-transports", ",".join(args.ttft_transports)]
    parts += ["--no-ttft"] if args.no_ttft else []
    parts += ["--no-throughput"] if args.no_throughput else []
    parts += ["--output", str(args.output)]
    parts += ["--json", str(args.json)] if args.json else []
    return shlex.join(parts)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "—" if value is None else format(value * scale, spec)


def render_markdown(rep: Report) -> str:
    lines = ["# pdserve KV transfer benchmark", "", *_header(rep), ""]
    if rep.throughput:
        lines += ["## Transport throughput", "", *_throughput_table(rep), ""]
        lines += ["## Raw baselines", "", *_baseline_table(rep), ""]
        lines += ["## Where the time goes (codec none, largest size)", "", *_stage_table(rep), ""]
        lines += ["## Codec CPU cost (this process, 1 thread)", "", *_codec_table(rep), ""]
    if rep.ttft:
        lines += ["## TTFT breakdown (1P1D, LocalCluster, 1 thread per worker)", ""]
        lines += [*_ttft_table(rep), ""]
    lines += [
        "## Targets",
        "",
        *report.targets_table(rep.targets),
        "",
        *_notes(rep),
    ]
    return "\n".join(lines) + "\n"


def _header(rep: Report) -> list[str]:
    m, lay = rep.machine, rep.layout
    loads = ", ".join(f"{k} {v[0]:.2f}" for k, v in m.get("load_by_part", {}).items())
    return [
        *report.head_lines(rep),
        f"- machine: {m['cpu']}, {m['cores']} cores, 1 torch thread per process, "
        f"torch {m['torch']}, pyzmq {m['pyzmq']} (libzmq {m['libzmq']}), python {m['python']}",
        f"- load average (1 min) at start/end: {report.load_span(m)}"
        + (f"; at the start of each part: {loads}" if loads else "")
        + " (a shared machine: other jobs ran alongside)",
        f"- code: git {m.get('git_head') or 'unknown'}"
        + (
            f" at the start, {m['git_head_end']} at the end (the code changed during the run)"
            if m.get("git_head_end") != m.get("git_head")
            else ""
        )
        + " (plus any uncommitted changes in the checkout)",
        f"- KV layout: {lay.name}, {lay.layers} layers x {lay.kv_heads} KV heads x head_dim "
        f"{lay.head_dim}, {lay.dtype}: {lay.bytes_per_token:,} bytes/token (K and V)",
        f"- every time is a median of {rep.settings['repeats']} runs after a warm-up run"
        + (
            f"; TTFT: median of {rep.settings['ttft_requests']} requests after a warm-up request"
            if rep.ttft
            else ""
        ),
    ]


def _throughput_table(rep: Report) -> list[str]:
    out = [
        "One frame per layer; seconds from the first encode to the receiver's ack of the batch. "
        "eff GB/s = raw KV bytes / s; ratio = eff GB/s / baseline GB/s (codec none).",
        "",
    ]
    header = ("transport", "codec", "tokens", "raw MB", "wire MB", "ms", "eff GB/s", "wire GB/s",
              "baseline", "baseline GB/s", "ratio", "spread")  # fmt: skip
    rows = [
        (
            f"{r.transport}{f' ({r.inline_frames} inline)' if r.inline_frames else ''}",
            r.codec,
            r.tokens,
            _mb(r.raw_bytes),
            _mb(r.wire_bytes),
            f"{r.seconds * 1e3:.1f}",
            f"{r.effective_gbs:.2f}",
            f"{r.wire_gbs:.2f}",
            r.baseline or "—",
            _fmt(r.baseline_gbs, ".2f"),
            _fmt(r.ratio, ".0%"),
            f"{r.spread:.2f}{' (!)' if r.spread > NOISY_SPREAD else ''}",
        )
        for r in rep.throughput
    ]
    return out + report.markdown_table(header, rows, "llrrrrrrlrrr")


def _baseline_table(rep: Report) -> list[str]:
    kinds = list(dict.fromkeys(b.kind for b in rep.baselines))
    sizes = list(dict.fromkeys(b.tokens for b in rep.baselines))
    by_key = {(b.kind, b.tokens): b for b in rep.baselines}
    out = [
        "GB/s of raw KV bytes (the codec-none frames moved: memcpy x2 = into a shared-memory "
        "segment and out into a tensor, per layer, one process; copy = one torch copy of the "
        "whole KV; sockets = sendall per layer to a receiver process that recv_into's a "
        "preallocated buffer and replies).",
        "",
    ]
    rows = [(n, *(_baseline_cell(by_key.get((k, n))) for k in kinds)) for n in sizes]
    return out + report.markdown_table(("tokens", *kinds), rows, "r" * (1 + len(kinds)))


def _baseline_cell(b: BaselineRow | None) -> str:
    if b is None:
        return "—"
    return f"{b.gbs:.2f}" + (" (!)" if b.spread > NOISY_SPREAD else "")


_STAGES = (
    ("encode_s", "sender: encode_frame (codec + CRC-32)"),
    ("pack_s", "sender: shm ring copy"),
    ("send_s", "sender: send_multipart"),
    ("sender_done_s", "sender: last frame handed to zmq, since start"),
    ("first_frame_s", "receiver: first frame in hand, since start"),
    ("decode_frame_s", "receiver: decode_frame (header checks + CRC-32 of the parts)"),
    ("codec_decode_s", "receiver: codec decode (a view of the received buffer, or a copy)"),
    ("store_s", "receiver: index_copy_ into the paged cache"),
    ("last_frame_s", "receiver: last frame stored, since start"),
    ("total_s", "total (ack received)"),
    ("sender_faults", "sender: minor page faults (4 KiB pages first touched)"),
    ("receiver_faults", "receiver: minor page faults (4 KiB pages first touched)"),
    ("in_place_tensors", "receiver: K/V tensors decoded in place (views, no copy)"),
    ("decoded_tensors", "receiver: K/V tensors decoded"),
)


def _stage_table(rep: Report) -> list[str]:
    rows = [r for r in rep.throughput if r.codec == "none"]
    if not rows:
        return ["(codec none not run)"]
    n = max(r.tokens for r in rows)
    rows = [r for r in rows if r.tokens == n]
    out = [
        f"ms of the median run at {n} tokens; sender and receiver run in parallel "
        "(two processes, plus zmq's I/O threads for tcp/ipc).",
        "",
    ]
    table = [(label, *(_stage_cell(key, r.stages[key]) for r in rows)) for key, label in _STAGES]
    header = ("stage", *(r.transport for r in rows))
    return out + report.markdown_table(header, table, "l" + "r" * len(rows))


def _stage_cell(key: str, value: float) -> str:
    return f"{value:,.0f}" if not key.endswith("_s") else f"{value * 1e3:.1f}"


def _codec_table(rep: Report) -> list[str]:
    out = [
        "GB/s of raw KV bytes; encode = encode_frame of every layer, decode+store = decode_frame "
        "+ codec decode + index_copy_ (what the receiver does per frame).",
        "",
    ]
    rows = [
        (
            c.codec,
            c.tokens,
            f"{c.wire_bytes / c.raw_bytes:.3f}",
            f"{c.encode_gbs:.2f}",
            f"{c.decode_gbs:.2f}",
        )
        for c in rep.codecs
    ]
    header = ("codec", "tokens", "wire/raw", "encode GB/s", "decode+store GB/s")
    out += report.markdown_table(header, rows, "lrrrr")
    if rep.crc32_gbs is not None:
        out += ["", f"zlib.crc32 on {CRC_MB} MB: {rep.crc32_gbs:.2f} GB/s."]
    return out


def _ttft_table(rep: Report) -> list[str]:
    out = [
        "ms, medians; exposed = KV still in flight after P sampled its first token "
        "(recv:done - send:first_token); transfer = recv:done - send:ready (whole window).",
        "",
    ]
    header = ("transport", "streaming", "prompt", "TTFT", "queue", "prefill", "exposed",
              "exposed % TTFT", "first decode", "time to decode", "transfer", "KV MB",
              "errors")  # fmt: skip
    rows = [
        (
            r.transport,
            "yes" if r.stream_kv else "no",
            r.prompt_tokens,
            *(_fmt(r.medians.get(k), ".1f", 1e3) for k in ("ttft", "queue", "prefill", "exposed")),
            _fmt(r.exposed_pct, ".1%"),
            *(_fmt(r.medians.get(k), ".1f", 1e3) for k in ("first_decode", "time_to_decode")),
            _fmt(r.transfer_s, ".1f", 1e3),
            _mb(r.kv_bytes),
            len(r.errors),
        )
        for r in rep.ttft
    ]
    return out + report.markdown_table(header, rows, "ll" + "r" * 11)


def _notes(rep: Report) -> list[str]:
    notes = ["## Notes", ""]
    noisy = [
        f"{r.transport}/{r.codec}/{r.tokens} ({r.spread:.2f}x)"
        for r in rep.throughput
        if r.spread > NOISY_SPREAD
    ] + [
        f"baseline {b.kind}/{b.tokens} ({b.spread:.2f}x)"
        for b in rep.baselines
        if b.spread > NOISY_SPREAD
    ]
    if noisy:
        notes.append(
            f"- Noisy rows (slowest/fastest repeat > {NOISY_SPREAD}x), marked (!): "
            + ", ".join(noisy)
            + "."
        )
    notes += [*_bottleneck_notes(rep), *_ttft_notes(rep)]
    if any(r.inline_frames for r in rep.throughput):
        notes.append(
            f"- Some shm frames did not fit the {SHM_MB} MiB ring and went inline (marked)."
        )
    notes += [
        "- The receiver's path per frame (what `DecodeSide` does): `decode_frame` checks the "
        "header and runs CRC-32 over the received parts; the codec decodes each layer's K and V "
        "(for codec none a view of the received buffer when it is writable and aligned, else a "
        "copy: the stage table counts which); `index_copy_` copies them into the paged cache. "
        "tcp/ipc add the kernel's send and receive copies (zmq's I/O threads), shm the sender's "
        "copy into the ring. The raw baselines do 2 copies and no checksum.",
        "- TTFT: P and D each run 1 torch thread in their own process; D is idle while it "
        "receives, so it polls its sockets (5 ms timeout) and stores each frame as it arrives; a "
        "busy D would only poll between its engine steps. Times come from time.monotonic() "
        "stamps of P, D and the cluster (one system-wide clock).",
        "- Method: `pdserve.bench.transfer.transfer_bench` (module docstring).",
        "",
    ]
    return notes


def _bottleneck_notes(rep: Report) -> list[str]:
    out: list[str] = []
    rows = [r for r in rep.throughput if r.codec == "none"]
    if not rows:
        return out
    n = max(r.tokens for r in rows)
    for r in (r for r in rows if r.tokens == n):
        s = r.stages
        send = s["encode_s"] + s["pack_s"] + s["send_s"]
        recv = s["decode_frame_s"] + s["codec_decode_s"] + s["store_s"]
        parts = {
            "decode_frame (CRC-32)": s["decode_frame_s"],
            "codec decode": s["codec_decode_s"],
            "index_copy_": s["store_s"],
        }
        top = max(parts, key=lambda k: parts[k])
        out.append(
            f"- {r.transport}, {n} tokens, codec none: {s['total_s'] * 1e3:.0f} ms in all; the "
            f"sender is busy {send * 1e3:.0f} ms (encode incl. CRC-32 {s['encode_s'] * 1e3:.0f}"
            f", ring copy {s['pack_s'] * 1e3:.0f}, send {s['send_s'] * 1e3:.0f}), the receiver "
            f"{recv * 1e3:.0f} ms ({', '.join(f'{k} {v * 1e3:.0f}' for k, v in parts.items())}"
            f"; the largest is {top}; {s.get('in_place_tensors', 0):.0f} of "
            f"{s.get('decoded_tensors', 0):.0f} tensors decoded in place) and first-touches "
            f"{s['receiver_faults'] * 4096 / 1e6:,.0f} MB of freshly allocated pages for "
            f"{r.raw_bytes / 1e6:,.0f} MB of KV; its last frame is stored "
            f"{(s['last_frame_s'] - s['sender_done_s']) * 1e3:.0f} ms after the sender's last "
            "send." + _alone(rep, r)
        )
    out += _ceiling_notes(rep, rows)
    out += _left_notes(rep, rows)
    return out


def _left_notes(rep: Report, rows: list[ThroughputRow]) -> list[str]:
    missed = [r for r in rows if r.ratio is not None and r.ratio < TARGET_RATIO]
    copy = [b for b in rep.baselines if b.kind == "copy"]
    if not missed or rep.crc32_gbs is None or not copy:
        return []
    big = max(copy, key=lambda b: b.tokens)
    n = max(r.tokens for r in rows)
    shares = []
    for r in (r for r in rows if r.tokens == n):
        st = r.stages
        crc = st["encode_s"] + st["decode_frame_s"]  # codec none: encode is CRC-32 + headers
        busy = crc + st["pack_s"] + st["send_s"] + st["codec_decode_s"] + st["store_s"]
        shares.append(f"{r.transport} {crc / busy:.0%}")
    return [
        f"- Left between the transports and their baselines (codec none): CRC-32 on both sides "
        f"(zlib.crc32 runs at {rep.crc32_gbs:.2f} GB/s here, one torch copy of the KV at "
        f"{big.gbs:.2f} GB/s), per-frame Python work at small sizes, fresh pages for received "
        "buffers (the page-fault rows), and CPU contention: sender, receiver and, for tcp/ipc, "
        f"zmq's two I/O threads on {rep.machine['cores']} cores. At {n} tokens CRC-32 (the "
        "sender's encode_frame and the receiver's decode_frame) is this share of the two "
        f"processes' busy time: {', '.join(shares)}; a cheaper checksum (hardware CRC32C, or "
        "none for same-host shm) would cut the largest single cost."
    ]


def _alone(rep: Report, r: ThroughputRow) -> str:
    """The same CPU work measured alone (codec table), to show contention in the transport run."""
    c = next((c for c in rep.codecs if c.codec == r.codec and c.tokens == r.tokens), None)
    if c is None:
        return ""
    threads = (
        "sender, receiver and zmq's two I/O threads"
        if r.transport != "shm"
        else "sender and receiver"
    )
    return (
        f" Alone (codec table) the same encode takes {c.encode_s * 1e3:.0f} ms and the "
        f"receiver's work {c.decode_s * 1e3:.0f} ms: in the transport run {threads} share "
        f"{rep.machine['cores']} cores with any other jobs on this machine."
    )


def _ceiling_notes(rep: Report, rows: list[ThroughputRow]) -> list[str]:
    """How far the receiver's own CPU work caps each transport, and per-frame overhead."""
    out = []
    codec = {c.tokens: c for c in rep.codecs if c.codec == "none"}
    big = max(r.tokens for r in rows)
    if big in codec:
        cap = codec[big].decode_gbs
        caps = [
            f"{r.transport} {cap / r.baseline_gbs:.0%}"
            for r in rows
            if r.tokens == big and r.baseline_gbs
        ]
        out.append(
            f"- Ceiling: the receiver's work alone (decode+store, codec none, {big} tokens, one "
            f"thread, no transport at all) runs at {cap:.2f} GB/s, so even with sender and "
            f"receiver perfectly overlapped a transport could reach at most "
            f"{', '.join(caps)} of its baseline here; the sender's encode (CRC-32) alone runs at "
            f"{codec[big].encode_gbs:.2f} GB/s."
        )
    small = min(r.tokens for r in rows)
    if small not in codec or big not in codec or small == big:
        return out
    c, b = codec[small], codec[big]
    per_frame = (c.encode_s + c.decode_s) / rep.layout.layers * 1e3
    gbs = [x.raw_bytes / (x.encode_s + x.decode_s) / 1e9 for x in (c, b)]
    if gbs[0] < 0.8 * gbs[1]:  # a visible per-frame cost
        out.append(
            f"- At {small} tokens a frame carries {c.raw_bytes / rep.layout.layers / 1e3:,.0f} kB "
            f"and costs {per_frame:.2f} ms of encode + decode+store CPU ({gbs[0]:.2f} GB/s, "
            f"against {gbs[1]:.2f} GB/s at {big} tokens): the difference is fixed per-frame "
            "cost (Python header pack/parse, dataclasses.replace, ~9 zlib.crc32 calls on the two "
            "sides, tensor wrappers), plus, in the transport rows, the batch's ack round trip."
        )
    return out


def _ttft_notes(rep: Report) -> list[str]:
    out = []
    for transport in dict.fromkeys(r.transport for r in rep.ttft):
        by_mode = {
            r.stream_kv: r
            for r in rep.ttft
            if r.transport == transport and r.prompt_tokens == max(rep.settings["ttft_lens"])
        }
        on, off = by_mode.get(True), by_mode.get(False)
        if not on or not off or not on.medians or not off.medians:
            continue
        exposed_off = off.medians["exposed"]
        out.append(
            f"- TTFT, {transport}, {on.prompt_tokens} tokens: prefill compute is "
            f"{on.medians['prefill'] / on.medians['ttft']:.0%} of TTFT "
            f"({on.medians['prefill'] * 1e3:,.0f} ms on one thread), so the "
            f"{_mb(on.kv_bytes)} MB of KV hide behind it: exposed "
            f"{on.medians['exposed'] * 1e3:.1f} ms with streaming, "
            f"{exposed_off * 1e3:.1f} ms without (all of it after the prefill). Without "
            f"streaming that {exposed_off * 1e3:.0f} ms would exceed {TARGET_EXPOSED:.0%} of any "
            f"TTFT under {exposed_off / TARGET_EXPOSED * 1e3:,.0f} ms (a faster prefill); time to "
            f"D's first token: {on.medians['time_to_decode'] * 1e3:,.0f} ms streaming, "
            f"{off.medians['time_to_decode'] * 1e3:,.0f} ms not."
        )
    return out


def report_json(rep: Report) -> dict[str, Any]:
    data = asdict(rep)
    data["layout"]["bytes_per_token"] = rep.layout.bytes_per_token
    for row, raw in zip(rep.throughput, data["throughput"], strict=True):
        raw["spread"] = row.spread
    for b, raw in zip(rep.baselines, data["baselines"], strict=True):
        raw.update(gbs=b.gbs, spread=b.spread)
    for c, raw in zip(rep.codecs, data["codecs"], strict=True):
        raw.update(encode_gbs=c.encode_gbs, decode_gbs=c.decode_gbs)
    for t, raw in zip(rep.targets, data["targets"], strict=True):
        raw["status"] = t.status
    return data
