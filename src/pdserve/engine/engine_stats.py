"""`LLMEngine.stats()`: one flat dict of the engine's settings and counters (the worker sends it
to /admin/workers and the Prometheus exporter), and the KV pool's use as this engine saw it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.engine import prefill_format

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.pool_link import PoolLink


def collect(engine: LLMEngine) -> dict[str, Any]:
    kv = engine.kv_manager
    sched = engine.scheduler
    return {
        "quantization": engine.quantization,
        "kv_cache_dtype": str(engine.cache.dtype).removeprefix("torch."),
        "decode_matmul": engine.decode_matmul,
        **prefill_format.stats(engine.prefill_choice, engine.model.step_rows),
        "waiting": sched.num_waiting,
        "running": sched.num_running,
        "kv_blocks_total": kv.num_blocks,
        "kv_blocks_used": kv.num_blocks - kv.num_free_blocks,
        "prefix_cache_hit_rate": kv.stats.hit_rate,
        "prefix_cache_hit_tokens": kv.stats.hits,
        "prefix_cached_blocks": kv.pool.num_cached_blocks,
        "preemptions": sched.num_preemptions,
        **engine._batch,
        **engine._tokens,
        "forked_choices": engine._forks,
        "grammar_errors": engine._grammar_errors,
        "fork_recomputes": sched.num_fork_recomputes,
        "held_for_transfer": len(sched.held),
        "reserved_for_transfer": len(engine._reserved),
        **pool_stats(engine.pool_link),
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
