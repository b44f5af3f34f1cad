"""`pdserve bench transfer`: how fast KV moves from a prefill to a decode worker, against raw
baselines of the same machine measured in the same run, and how much of it a request still waits
for after its first token (TTFT breakdown, with and without layer-wise streaming).

Transport throughput (per transport x codec x KV size n, on random KV of the model's layout):
  * sender = this process, doing what `PrefillSide` does per layer: `encode_frame` of that
    layer's K and V for n tokens (one frame per layer), then the multipart message for the link
    ([b"F", header, K, V] inline, or for shm the payload copied into a `ShmRing` and
    [b"S", header, ring reference]) and `send_multipart(copy=False)` on a DEALER from
    `connect_sender`; after the last layer a "done" message;
  * receiver = a separate process (multiprocessing, spawn), doing what `DecodeSide` does: a ROUTER
    from `bind_receiver`; per frame `peek_header` + `decode_frame` (the parts are joined into one
    buffer, CRC-32 checked, layout fingerprint checked) and per layer the codec's decode and an
    `index_copy_` into a preallocated paged cache at block-shuffled slots (as `write_kv`); on
    "done" it acknowledges the whole batch;
  * seconds = from the first encode to the acknowledgement, median of `--repeats` runs after one
    warm-up run. Effective GB/s = raw KV bytes / s; wire GB/s = frame bytes (headers included)
    / s. Every run also records where each side spent its time (time.monotonic stamps, which are
    system-wide on Linux, so sender and receiver share one clock).
Raw baselines (same bytes: the "none" frames of that size, per layer):
  * shm: memcpy x2, each layer's frame copied into a shared-memory segment and out of it into a
    tensor (what a shared-memory path must do at least), in one process; plus one torch copy of
    the whole KV for reference;
  * tcp / ipc: a plain loopback socket (TCP_NODELAY) / Unix stream socket: `sendall` of each
    layer's frame to a receiver process that `recv_into`s a preallocated bytearray and replies
    one byte when all arrived;
  * ratio = transport GB/s / baseline GB/s, codec none (inproc is compared with the torch copy).
Codec CPU cost, this process: encode = `encode_frame` of every layer (CRC-32 included);
decode+store = `decode_frame` + codec decode + `index_copy_` of those frames.

TTFT breakdown: `LocalCluster(model, 1P1D, transport, stream_kv=True/False, threads=1)`; per
prompt length a warm-up request, then `--ttft-requests` requests of random token ids, one at a
time (no queueing), `SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)`. From each
request's timeline:
  queue            = send:prefill_start - dispatch
  prefill compute  = send:first_token - send:prefill_start
  exposed transfer = max(0, recv:done - send:first_token)   KV still in flight after P's token
  first decode     = first_token (D) - recv:done
  TTFT             = first_token (P) - dispatch;  time to decode = first_token (D) - dispatch
Medians over the requests; exposed % = median of exposed / TTFT per request.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve import argtypes
from pdserve.bench.harness import report, timing
from pdserve.bench.transfer.transfer_baselines import (
    attach_baselines,
    measure_codecs,
    run_baselines,
)
from pdserve.bench.transfer.transfer_link import run_throughput
from pdserve.bench.transfer.transfer_report import (
    command_line,
    machine_info,
    render_markdown,
    report_json,
)
from pdserve.bench.transfer.transfer_results import (
    BASELINE_OF,
    BREAKDOWN,
    CODEC_NAMES,
    CRC_MB,
    DEFAULT_OUTPUT,
    SEED,
    TARGET_EXPOSED,
    TARGET_EXPOSED_LEN,
    TARGET_RATIO,
    TRANSPORT_NAMES,
    TTFT_DEADLINE_S,
    TTFT_MAX_TOKENS,
    Layout,
    Report,
    TtftRow,
)
from pdserve.router import timeline as tl

if TYPE_CHECKING:
    from pdserve.cluster import LocalCluster
    from pdserve.engine.outputs import RequestOutput


# --------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF folder or .gguf (its KV layout); default: SmolLM2-135M"
    )
    parser.add_argument(
        "--sizes", type=argtypes.int_list, default=[128, 512, 2048, 8192], help="KV sizes in tokens"
    )
    parser.add_argument(
        "--transports",
        type=argtypes.subset(TRANSPORT_NAMES),
        default=["tcp", "ipc", "shm"],
        help="transports of the throughput part: tcp,ipc,shm (inproc: receiver thread)",
    )
    parser.add_argument(
        "--codecs", type=argtypes.subset(CODEC_NAMES), default=list(CODEC_NAMES), help="KV codecs"
    )
    parser.add_argument(
        "--repeats",
        type=argtypes.positive_int,
        default=3,
        help="timed runs per measurement (median)",
    )
    parser.add_argument(
        "--ttft-lens", type=argtypes.int_list, default=[512, 2048], help="TTFT prompt lengths"
    )
    parser.add_argument(
        "--ttft-requests", type=argtypes.positive_int, default=3, help="TTFT requests per length"
    )
    parser.add_argument(
        "--ttft-transports",
        type=argtypes.subset(("tcp", "ipc", "shm")),
        default=["tcp", "shm"],
        help="transports of the TTFT part",
    )
    parser.add_argument("--no-ttft", action="store_true", help="skip the TTFT breakdown")
    parser.add_argument(
        "--no-throughput", action="store_true", help="skip the throughput part and baselines"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="markdown report")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")


# --------------------------------------------------------------------------- TTFT breakdown


def _event(timeline: list[tuple[str, str, float]], name: str, worker: str | None = None) -> float:
    for event, who, t in timeline:
        if event == name and (worker is None or who == worker):
            return t
    raise KeyError(name if worker is None else f"{name} ({worker})")


def breakdown(timeline: list[tuple[str, str, float]]) -> dict[str, float]:
    """Seconds of each stage of one P/D request (see the module docstring)."""
    p_worker = next(w for e, w, _ in timeline if tl.kind_of(e) == tl.Side.SEND)
    d_worker = next(w for e, w, _ in timeline if tl.kind_of(e) == tl.Side.RECV)
    dispatch = _event(timeline, tl.Ev.DISPATCH)
    start = _event(timeline, tl.staged(tl.Side.SEND, "prefill_start"))
    p_first = _event(timeline, tl.staged(tl.Side.SEND, "first_token"))
    done = _event(timeline, tl.staged(tl.Side.RECV, "done"))
    tok_p, tok_d = (
        _event(timeline, tl.Ev.FIRST_TOKEN, p_worker),
        _event(timeline, tl.Ev.FIRST_TOKEN, d_worker),
    )
    return {
        "queue": start - dispatch,
        "prefill": p_first - start,
        "exposed": max(0.0, done - p_first),
        "first_decode": tok_d - done,
        "ttft": tok_p - dispatch,
        "time_to_decode": tok_d - dispatch,
        "transfer": done - _event(timeline, tl.staged(tl.Side.SEND, "ready")),
    }


def _ttft_request(cluster: LocalCluster, ids: list[int], params: Any) -> tuple[RequestOutput, int]:
    before = cluster.stats["kv_send_bytes"]
    out = cluster.generate([ids], params)[0]
    return out, cluster.stats["kv_send_bytes"] - before


def run_ttft(args: argparse.Namespace, vocab: int) -> list[TtftRow]:
    import torch

    from pdserve import SamplingParams
    from pdserve.cluster import LocalCluster

    params = SamplingParams(max_tokens=TTFT_MAX_TOKENS, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(SEED)
    vocab = min(vocab, 49000)
    rows = []
    for transport in args.ttft_transports:
        for stream in (True, False):
            report.log(f"TTFT: {transport}, stream_kv={stream}: starting 1P1D")
            with LocalCluster(
                args.model,
                transport=transport,
                stream_kv=stream,
                threads=1,
                deadline_s=TTFT_DEADLINE_S,
                lease_s=2 * TTFT_DEADLINE_S,
            ) as cluster:
                for n in args.ttft_lens:
                    report.log(f"TTFT: {transport}, stream_kv={stream}, {n} tokens")
                    _ttft_request(cluster, timing.random_ids(gen, n, vocab), params)  # warm-up
                    runs = [
                        _ttft_request(cluster, timing.random_ids(gen, n, vocab), params)
                        for _ in range(args.ttft_requests)
                    ]
                    rows.append(_ttft_row(transport, stream, n, runs))
    return rows


def _ttft_row(
    transport: str, stream: bool, n: int, runs: list[tuple[RequestOutput, int]]
) -> TtftRow:
    samples, errors, nbytes = [], [], []
    for out, sent in runs:
        if out.error:
            errors.append(out.error)
            continue
        try:
            samples.append(breakdown(list(out.timeline or [])))
            nbytes.append(sent)
        except (KeyError, StopIteration) as e:
            errors.append(f"timeline lacks {e}")
    medians = {k: statistics.median(s[k] for s in samples) for k in BREAKDOWN} if samples else {}
    pct = [s["exposed"] / s["ttft"] for s in samples if s["ttft"] > 0]
    return TtftRow(
        transport=transport,
        stream_kv=stream,
        prompt_tokens=n,
        medians=medians,
        exposed_pct=statistics.median(pct) if pct else None,
        transfer_s=statistics.median(s["transfer"] for s in samples) if samples else None,
        kv_bytes=int(statistics.median(nbytes)) if nbytes else 0,
        samples=samples,
        errors=errors,
    )


# --------------------------------------------------------------------------- targets


def evaluate_targets(rep: Report) -> list[report.Target]:
    targets = []
    for transport in dict.fromkeys(r.transport for r in rep.throughput):
        rows = [r for r in rep.throughput if r.transport == transport and r.ratio is not None]
        name = (
            f"{transport}: codec none >= {TARGET_RATIO:.0%} of the raw baseline "
            f"({BASELINE_OF[transport]}), at the largest size"
        )
        if not rows:
            targets.append(report.Target(name, "not run", None))
            continue
        big = max(rows, key=lambda r: r.tokens)
        assert big.ratio is not None
        every = ", ".join(f"{r.tokens}: {r.ratio:.0%}" for r in rows)
        targets.append(
            report.Target(
                name, f"{big.ratio:.0%} at {big.tokens} (all: {every})", big.ratio >= TARGET_RATIO
            )
        )
    for transport in dict.fromkeys(r.transport for r in rep.ttft):
        name = (
            f"{transport}: exposed transfer <= {TARGET_EXPOSED:.0%} of TTFT at "
            f"{TARGET_EXPOSED_LEN} tokens, streaming"
        )
        row = next(
            (
                r
                for r in rep.ttft
                if r.transport == transport
                and r.stream_kv
                and r.prompt_tokens == TARGET_EXPOSED_LEN
            ),
            None,
        )
        if row is None or row.exposed_pct is None:
            targets.append(report.Target(name, "not run", None))
        else:
            ms = row.medians["exposed"] * 1e3
            targets.append(
                report.Target(
                    name, f"{row.exposed_pct:.1%} ({ms:.1f} ms)", row.exposed_pct <= TARGET_EXPOSED
                )
            )
    return targets


# --------------------------------------------------------------------------- entry point


def load_layout(model: str | None) -> tuple[Layout, int]:
    """The model's KV layout (float32, the engine's default dtype) and vocabulary size."""
    from pdserve.engine import loader

    source = loader.resolve_model(model)
    arch = loader.load_arch(source)
    name = arch.name or source.path.name
    layout = Layout(name, arch.num_layers, arch.num_kv_heads, arch.head_dim, "float32")
    return layout, arch.vocab_size


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    date = report.now()
    machine = machine_info()
    layout, vocab = load_layout(args.model)
    rep = Report(
        date=date,
        command=command_line(args),
        machine=machine,
        layout=layout,
        settings=_settings(args),
    )
    loads: dict[str, list[float]] = {}
    if not args.no_throughput:
        loads["throughput"] = report.load_average()
        rep.throughput = run_throughput(args, layout)
        loads["baselines"] = report.load_average()
        rep.baselines = run_baselines(args, layout)
        attach_baselines(rep.throughput, rep.baselines)
        loads["codecs"] = report.load_average()
        rep.codecs = measure_codecs(args, layout)
        rep.crc32_gbs = timing.measure_crc32(CRC_MB, args.repeats)
    if not args.no_ttft:
        loads["ttft"] = report.load_average()
        rep.ttft = run_ttft(args, vocab)
    machine["load_by_part"] = loads
    machine["load_average_end"] = report.load_average()
    machine["git_head_end"] = report.git_head()
    rep.targets = evaluate_targets(rep)
    report.write(render_markdown(rep), report_json(rep), args)
    return 0


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    names = (
        "sizes", "transports", "codecs", "repeats", "ttft_lens", "ttft_requests",
        "ttft_transports", "no_ttft", "no_throughput",
    )  # fmt: skip
    return {k: getattr(args, k) for k in names}


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.bench.transfer.transfer_bench", description=__doc__.split("\n\n")[0]
    )
    add_arguments(parser)
    parser.set_defaults(prog=parser.prog)
    try:
        return run(parser.parse_args(argv))
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
