"""What a load run produced: one `RequestRecord` per request, and the summary of a run —
latency percentiles, outcomes (completed / rejected / failed), SLO goodput, per-phase splits —
as the result dict `bench serve` prints (`format_table`) and writes (`harness.report`).
Percentiles are `pdserve.percentiles`'s (numpy's linear interpolation)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve import percentiles
from pdserve.workloads.spec import LoadSpec

MAX_ERRORS = 5  # distinct error messages kept in the JSON
NOT_JSON = ("itl_ms", "answer")  # record fields left out of the JSON (size)


@dataclass
class RequestRecord:
    id: int
    conversation: int
    turn: int
    prompt_len: int  # ids sent (words with --prompt-format text; rag: tokens of its text)
    max_tokens: int
    send_s: float = 0.0  # send time, from the start of the run
    response_id: str | None = None  # the server's id of the completion (pdserve: its timeline)
    prompt_tokens: int | None = None  # from usage, when the server reports it
    output_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    error: str | None = None
    phase: str | None = None  # the item's phase label (shifting, mixed)
    user: str | None = None  # the OpenAI `user` field sent ("conv-<n>")
    rejected: bool = False  # answered 429/503: refused, not failed
    reject_code: str | None = None  # error.code of the refusal, else "http_<status>"
    reject_ms: float | None = None  # send -> the refusal's status line
    retry_after_s: float | None = None  # its Retry-After header, when numeric
    itl_ms: list[float] = field(default_factory=list)  # not written to the JSON (size)
    answer: str = ""  # the streamed text, for the next turn's prompt; not in the JSON

    @property
    def ok(self) -> bool:
        """Completed: admitted and streamed to the end without an error."""
        return self.error is None and not self.rejected


def is_good(rec: RequestRecord, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    """Completed and within every given SLO (seconds); TPOT is vacuous for 1-token outputs."""
    if not rec.ok or rec.ttft_ms is None:
        return False
    if slo_ttft is not None and rec.ttft_ms > slo_ttft * 1e3:
        return False
    return not (slo_tpot is not None and rec.tpot_ms is not None and rec.tpot_ms > slo_tpot * 1e3)


def is_good_dict(r: dict[str, Any], slo_ttft: float | None, slo_tpot: float | None) -> bool:
    """`is_good` on a record as written to the JSON (missing fields: not good)."""
    if r.get("error") is not None or r.get("rejected") or r.get("ttft_ms") is None:
        return False
    if slo_ttft is not None and r["ttft_ms"] > slo_ttft * 1e3:
        return False
    tpot = r.get("tpot_ms")
    return not (slo_tpot is not None and tpot is not None and tpot > slo_tpot * 1e3)


def _end_s(r: dict[str, Any]) -> float:
    """When a record's answer ended, from the start of the run (its send time if unknown)."""
    ms = r.get("e2e_ms") if r.get("e2e_ms") is not None else r.get("reject_ms")
    return float(r.get("send_s") or 0.0) + (float(ms) / 1e3 if ms is not None else 0.0)


def outcome_summary(
    requests: Sequence[dict[str, Any]],
    slo_ttft: float | None,
    slo_tpot: float | None,
    duration: float | None = None,
) -> dict[str, Any]:
    """Admission and SLO counts of JSON records: sent, admitted, rejected (by code), failed,
    completed, good; goodput (good / `duration`, default: first send -> last answer);
    slo_attainment (good / sent) and slo_attainment_admitted (good / admitted; None when nothing
    was admitted); rejection latency and Retry-After statistics. Works on older records too
    (no `rejected` field: nothing rejected)."""
    sent = len(requests)
    rejected = [r for r in requests if r.get("rejected")]
    admitted = sent - len(rejected)
    failed = sum(1 for r in requests if not r.get("rejected") and r.get("error") is not None)
    good = sum(is_good_dict(r, slo_ttft, slo_tpot) for r in requests)
    if duration is None:
        t0 = min((float(r.get("send_s") or 0.0) for r in requests), default=0.0)
        duration = max((_end_s(r) for r in requests), default=0.0) - t0
    by_code: dict[str, int] = {}
    for r in rejected:
        code = str(r.get("reject_code") or "unknown")
        by_code[code] = by_code.get(code, 0) + 1
    return {
        "sent": sent,
        "admitted": admitted,
        "rejected": len(rejected),
        "rejected_by_code": dict(sorted(by_code.items())),
        "failed": failed,
        "completed": admitted - failed,
        "good": good,
        "span_s": duration,
        "goodput": good / duration if duration > 0 else 0.0,
        "slo_attainment": good / sent if sent else None,
        "slo_attainment_admitted": good / admitted if admitted else None,
        "rejection_latency_ms": percentiles.summary(
            [r["reject_ms"] for r in rejected if r.get("reject_ms") is not None]
        ),
        "retry_after_s": percentiles.summary(
            [r["retry_after_s"] for r in rejected if r.get("retry_after_s") is not None]
        ),
    }


def by_phase(
    requests: Sequence[dict[str, Any]], slo_ttft: float | None, slo_tpot: float | None
) -> dict[str, dict[str, Any]]:
    """`outcome_summary` per `phase` label (in order of first appearance), goodput over each
    phase's own span (its first send -> its last answer); {} when no record has a phase."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(requests, key=lambda r: float(r.get("send_s") or 0.0)):
        if r.get("phase") is not None:
            groups.setdefault(str(r["phase"]), []).append(r)
    return {
        name: {**outcome_summary(rs, slo_ttft, slo_tpot), "ttft_ms": _ttft(rs)}
        for name, rs in groups.items()
    }


def _ttft(requests: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """TTFT percentiles of the records that completed (a phase's, e.g. turns 2+)."""
    ok = [r for r in requests if not r.get("rejected") and r.get("error") is None]
    return percentiles.summary([r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None])


def summarize(
    args: LoadSpec,
    model: str,
    workload: str,
    records: list[RequestRecord],
    duration: float,
) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    rows = [
        {k: v for k, v in asdict(r).items() if k not in NOT_JSON}
        for r in sorted(records, key=lambda r: r.send_s)
    ]
    outcome = outcome_summary(rows, args.slo_ttft, args.slo_tpot, max(duration, 1e-9))
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in done)
    errors: list[str] = []
    for r in records:
        if r.error is not None and r.error not in errors and len(errors) < MAX_ERRORS:
            errors.append(r.error)
    dur = max(duration, 1e-9)
    return {
        "config": {
            "url": args.url,
            "model": model,
            "workload": workload,
            "rate": args.rate,  # None in concurrency mode; inf is written as null below
            "burstiness": args.burstiness if args.rate else None,
            "concurrency": args.concurrency,
            "num_requests": len(records),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "len_spread": args.len_spread,
            "turns": args.turns if workload == "multiturn" else None,
            "multiturn_answers": (
                getattr(args, "multiturn_answers", None) if workload == "multiturn" else None
            ),
            "turns_range": getattr(args, "turns_range", None) if workload == "multiturn" else None,
            "think_time_s": getattr(args, "think_time", 0.0),
            "think_dist": getattr(args, "think_dist", "exponential"),
            "seed": args.seed,
            "slo_ttft_s": args.slo_ttft,
            "slo_tpot_s": args.slo_tpot,
            "prompt_format": args.prompt_format,
            "ignore_eos": args.ignore_eos,
            "backend": getattr(args, "backend", "openai"),
            "send_user": getattr(args, "send_user", True),
        },
        "completed": len(done),
        "failed": outcome["failed"],
        "errors": errors,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / dur,
        "output_throughput": out_tokens / dur,
        "input_throughput": in_tokens / dur,
        "good": outcome["good"],
        "goodput": outcome["goodput"],
        "good_fraction": outcome["good"] / len(records) if records else 0.0,
        "sent": outcome["sent"],
        "admitted": outcome["admitted"],
        "rejected": outcome["rejected"],
        "rejected_by_code": outcome["rejected_by_code"],
        "rejection_latency_ms": outcome["rejection_latency_ms"],
        "retry_after_s": outcome["retry_after_s"],
        "slo_attainment": outcome["slo_attainment"],
        "slo_attainment_admitted": outcome["slo_attainment_admitted"],
        "by_phase": by_phase(rows, args.slo_ttft, args.slo_tpot),
        "ttft_ms": percentiles.summary([r.ttft_ms for r in done if r.ttft_ms is not None]),
        "tpot_ms": percentiles.summary([r.tpot_ms for r in done if r.tpot_ms is not None]),
        "itl_ms": percentiles.summary([x for r in done for x in r.itl_ms]),
        "e2e_ms": percentiles.summary([r.e2e_ms for r in done if r.e2e_ms is not None]),
        "requests": rows,
    }


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_table(res: dict[str, Any]) -> str:
    cfg = res["config"]
    load = f"rate {cfg['rate']}/s" if cfg["rate"] else f"concurrency {cfg['concurrency']}"
    lines = [
        f"bench serve: {cfg['workload']}, {load}, {cfg['num_requests']} requests -> {cfg['url']}"
        f" ({cfg['model']})",
        f"completed {res['completed']}  failed {res['failed']}  duration {res['duration_s']:.2f} s",
        f"requests/s {res['request_throughput']:.2f}  output tok/s {res['output_throughput']:.1f}"
        f"  input tok/s {res['input_throughput']:.1f}",
        f"goodput {res['goodput']:.2f} req/s  good fraction {res['good_fraction']:.3f}",
    ]
    if res.get("rejected"):
        rl = res["rejection_latency_ms"]
        codes = ", ".join(f"{c} {n}" for c, n in res["rejected_by_code"].items())
        adm = res["slo_attainment_admitted"]
        lines += [
            f"sent {res['sent']}  admitted {res['admitted']}  rejected {res['rejected']} ({codes})",
            f"rejection latency p50 {fmt(rl['p50'])} ms  p99 {fmt(rl['p99'])} ms  "
            f"SLO attainment of admitted {'-' if adm is None else f'{adm:.3f}'}",
        ]
    for phase, ph in (res.get("by_phase") or {}).items():
        att = ph["slo_attainment"]
        lines.append(
            f"phase {phase}: sent {ph['sent']}  rejected {ph['rejected']}  good {ph['good']}  "
            f"goodput {ph['goodput']:.2f} req/s  attainment {'-' if att is None else f'{att:.3f}'}"
            f"  TTFT p50 {fmt(ph.get('ttft_ms', {}).get('p50'))} ms"
        )
    lines.append(f"{'ms':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = res[f"{name}_ms"]
        lines.append(f"{name.upper():<8}" + "".join(f"{fmt(s[k]):>10}" for k in s))
    lines += [f"error: {e}" for e in res["errors"]]
    return "\n".join(lines)
