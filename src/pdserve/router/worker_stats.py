"""`WorkerStats`: a worker's last report (`messages.Stats`), as the router reads it.

A worker sends its stats as one flat dict (the engine's `EngineStats.as_dict`, its own counters,
transfers in flight, KV pool use; workers/worker.py `Worker.stats`), polled every second. The
router parses it once, when it arrives, into this frozen record: routing, draining, the silence
policy and /admin read typed fields, never string keys. The whole report is kept (`report`) for
what only mirrors it: the Prometheus exporter and the dashboard's raw view.

A field the worker did not send keeps its default; `prefill_tokens` is None then, which the
silence policy (silence.py) reads as "no progress to judge yet".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

KV_POOL_PREFIX = "kv_pool_"  # the engine's own use of its KV pool (engine_stats.pool_stats)


@dataclass(frozen=True)
class WorkerStats:
    waiting: int = 0  # requests in the worker's queue: the policies' tie-break
    running: int = 0
    batch_requests: int | None = None  # in its last engine step
    transfers_out: int = 0  # hand-offs in flight (P side): a draining worker waits for them
    transfers_in: int = 0  # ... and on the D side
    prefill_tokens: int | None = None  # computed since start; None: not reported
    decode_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_hit_rate: float | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    decode_matmul: str | None = None
    prefill_format: str | None = None
    prefill_isa: str | None = None
    # speculation (engine/spec/): drafts verified and accepted, request-steps that verified
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_steps: int = 0
    threads: int | None = None  # torch intra-op threads now (the SetThreads acknowledgement)
    report: Mapping[str, Any] = field(default_factory=dict)  # everything it sent, read-only

    @classmethod
    def from_report(cls, report: Mapping[str, Any]) -> WorkerStats:
        """Parse a worker's report; a value of the wrong type counts as not sent (a peer's bug
        must not take the router's reader down)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "report" or f.name not in report:
                continue
            value = _typed(report[f.name], str(f.type))
            if value is not None:
                values[f.name] = value
        return cls(**values, report=MappingProxyType(dict(report)))

    def spec_per_step(self) -> tuple[float, float]:
        """(draft tokens verified, of which accepted) per decode request-step since the
        worker started: what the planner's TPOT expects of speculation there (router/slo.py)."""
        if not self.decode_tokens or not self.spec_steps:
            return 0.0, 0.0
        return self.spec_draft_tokens / self.decode_tokens, (
            self.spec_accepted_tokens / self.decode_tokens
        )

    def kv_pool_use(self) -> dict[str, Any]:
        """The engine's use of its KV pool (`kv_pool_*`, the prefix dropped)."""
        return {
            k.removeprefix(KV_POOL_PREFIX): v
            for k, v in self.report.items()
            if k.startswith(KV_POOL_PREFIX)
        }

    def kv_pool_tiers(self) -> dict[str, Any]:
        """The pool's tiers as this worker reported them (`kv_pool`; empty without a pool)."""
        tiers = self.report.get("kv_pool", {})
        return dict(tiers) if isinstance(tiers, Mapping) else {}


def _typed(value: Any, annotation: str) -> Any:
    """`value` as the field's type (from its annotation string), or None if it is not one."""
    if isinstance(value, bool):
        return None
    if annotation.startswith("int"):
        return int(value) if isinstance(value, int | float) else None
    if annotation.startswith("float"):
        return float(value) if isinstance(value, int | float) else None
    return value if isinstance(value, str) else None
