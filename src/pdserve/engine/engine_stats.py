"""The engine's stats: `StepCounters`, what the engine counts as it steps, and `EngineStats`,
one frozen record of an engine's settings and counters at one moment (`LLMEngine.stats_record`),
whose flat dict (`as_dict`, `LLMEngine.stats`) the worker sends to /admin/workers and the
Prometheus exporter; and the KV pool's use as this engine saw it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from pdserve.engine import prefill_format

if TYPE_CHECKING:
    from pdserve.engine.hybrid_kv import KVManager
    from pdserve.engine.linear.phases import StepRows
    from pdserve.engine.pool_link import PoolLink
    from pdserve.engine.scheduler import Scheduler, SchedulerOutput


@dataclass
class StepCounters:
    """Counted by the engine as it steps."""

    batch_requests: int = 0  # the last step's
    batch_tokens: int = 0
    prefill_tokens: int = 0  # computed since start
    decode_tokens: int = 0
    forked_choices: int = 0  # choices forked from another's KV (no prefill of their own)
    grammar_errors: int = 0  # requests whose grammar hit a library limit (ended with EOS)

    def count_step(self, out: SchedulerOutput) -> None:
        # a decode verifying drafts counts once here (its drafts in the spec_* counters)
        decode = sum(1 for s in out.scheduled if s.num_tokens - s.num_draft == 1 and s.sample)
        drafts = sum(s.num_draft for s in out.scheduled)
        self.batch_requests, self.batch_tokens = len(out.scheduled), out.num_batched_tokens
        self.decode_tokens += decode
        self.prefill_tokens += out.num_batched_tokens - decode - drafts


@dataclass(frozen=True)
class EngineStats:
    """An engine's settings and counters at one moment."""

    quantization: str
    kv_cache_dtype: str
    decode_matmul: str
    prefill: dict[str, object]  # prefill_format.stats: the prefill format's fields
    waiting: int
    running: int
    kv_blocks_total: int
    kv_blocks_used: int  # held by requests (blocks only kept conversation turns hold: kept)
    prefix_cache_hit_rate: float
    prefix_cache_hit_tokens: int
    prefix_cached_blocks: int
    preemptions: int
    counters: StepCounters  # a copy, taken with the rest
    fork_recomputes: int
    held_for_transfer: int
    reserved_for_transfer: int
    pool: dict[str, Any]  # pool_stats: `kv_pool_*` (empty without a pool)
    spec: dict[str, Any]  # speculation's counters: `spec_*` (empty without speculation)
    conversations: dict[str, int]  # conversation_stats: kept turns

    def as_dict(self) -> dict[str, Any]:
        """One flat dict, the record's fields in order (prefill, counters and pool spread)."""
        out: dict[str, Any] = {}
        for name, value in self.__dict__.items():
            if name in ("prefill", "pool", "spec", "conversations"):
                out.update(value)
            elif name == "counters":
                out.update(asdict(value))
            else:
                out[name] = value
        return out


def record(
    settings: tuple[str, str, str],
    prefill: prefill_format.PrefillChoice,
    step_rows: StepRows | None,
    scheduler: Scheduler,
    kv: KVManager,
    counters: StepCounters,
    reserved: int,
    link: PoolLink | None,
    spec: dict[str, Any],
) -> EngineStats:
    """The record of an engine with these parts; `settings`: its quantization, KV cache dtype
    and decode matmul; `reserved`: requests whose KV is on its way from P."""
    return EngineStats(
        *settings,
        prefill=prefill_format.stats(prefill, step_rows),
        waiting=scheduler.num_waiting,
        running=scheduler.num_running,
        kv_blocks_total=kv.num_blocks,
        kv_blocks_used=kv.num_blocks - kv.num_free_blocks - kv.num_kept_blocks,
        prefix_cache_hit_rate=kv.stats.hit_rate,
        prefix_cache_hit_tokens=kv.stats.hits,
        prefix_cached_blocks=kv.num_cached_blocks,
        preemptions=scheduler.num_preemptions,
        counters=replace(counters),
        fork_recomputes=scheduler.num_fork_recomputes,
        held_for_transfer=len(scheduler.held),
        reserved_for_transfer=reserved,
        pool=pool_stats(link),
        spec=spec,
        conversations=conversation_stats(kv),
    )


def conversation_stats(kv: KVManager) -> dict[str, int]:
    """Finished conversation turns kept for their next turn (engine/kept_turns.py)."""
    s = kv.kept.stats
    released = {f"conversation_released_{k}": v for k, v in s.released.items()}
    return {
        "conversation_turns_kept": s.kept,
        "conversation_kept_now": len(kv.kept),
        "kv_blocks_kept": kv.num_kept_blocks,
        "conversation_hits": s.hits,
        **released,
    }


def pool_stats(link: PoolLink | None) -> dict[str, Any]:
    """The KV pool as this engine used it (`kv_pool_*`; empty without a pool)."""
    if link is None:
        return {}
    own = {f"kv_pool_{k}": v for k, v in link.stats.as_dict().items()}
    try:
        tiers = link.pool.stats()
    except Exception as e:  # stats must never take a worker down
        tiers = {"error": str(e)}
    return {**own, "kv_pool": tiers}
