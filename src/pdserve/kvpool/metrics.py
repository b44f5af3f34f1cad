"""`pdserve_kvpool_*` metrics of one pool, in a registry given by its owner (or its own).

Counters and gauges are read at scrape time from the tiers' plain `TierStats` and `usage()`
(the same numbers `stats()` returns, so the two never disagree); latencies are histograms
observed as they happen. `close()` unregisters everything, so a later pool can use the registry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.kvpool.tiers import Tier

# fmt: off
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
# fmt: on
# TierStats field -> (metric name without pdserve_kvpool_ and _total, help)
COUNTERS = {
    "lookups": ("lookups", "lookup() calls that reached the tier."),
    "lookup_blocks": ("lookup_blocks", "Blocks asked of the tier by lookup()."),
    "hit_blocks": ("hit_blocks", "Blocks lookup() found in the tier (its part of the run)."),
    "get_blocks": ("get_blocks", "Blocks get() loaded from the tier and verified."),
    "bytes_read": ("read_bytes", "Bytes get() read from the tier."),
    "bytes_written": ("written_bytes", "Bytes written to the tier."),
    "puts": ("puts", "Values (chunks of blocks) written to the tier."),
    "present": ("present", "Writes skipped because the tier already had the key."),
    "evictions": ("evictions", "Values evicted to stay under the tier's capacity."),
    "corrupt": ("corrupt", "Values that failed verification (deleted, recomputed)."),
    "errors": ("errors", "Failed tier operations (I/O errors, Redis unreachable)."),
    "skipped": ("skipped", "Operations not tried because the tier was down."),
}


class PoolMetrics:
    def __init__(
        self,
        tiers: Sequence[Tier],
        block_size: int,
        pool_counters: Callable[[], dict[str, int]],
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._collector = _Collector(tiers, block_size, pool_counters)
        self.get_seconds = Histogram(
            "pdserve_kvpool_get_seconds",
            "Time to read one block's value from a tier (a batch's time over its blocks).",
            ["tier"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.put_seconds = Histogram(
            "pdserve_kvpool_put_seconds",
            "Time to write one block's value to a tier (a batch's time over its blocks).",
            ["tier"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(self._collector)

    def close(self) -> None:
        for collector in (self._collector, self.get_seconds, self.put_seconds):
            with contextlib.suppress(KeyError):  # already gone
                self.registry.unregister(collector)


class _Collector:
    def __init__(
        self, tiers: Sequence[Tier], block_size: int, pool_counters: Callable[[], dict[str, int]]
    ) -> None:
        self.tiers, self.block_size, self.pool_counters = tiers, block_size, pool_counters

    def describe(self) -> Iterable[Metric]:
        return []  # collect() at registration would be harmless, but there is nothing to check

    def collect(self) -> Iterable[Metric]:
        stats = {t.name: t.stats.as_dict() for t in self.tiers}
        for field, (name, doc) in COUNTERS.items():
            fam = CounterMetricFamily(f"pdserve_kvpool_{name}", doc, labels=["tier"])
            for tier, s in stats.items():
                fam.add_metric([tier], s[field])
            yield fam
        tokens = CounterMetricFamily(
            "pdserve_kvpool_hit_tokens", "Tokens of the blocks lookup() found.", labels=["tier"]
        )
        rate = GaugeMetricFamily(
            "pdserve_kvpool_hit_rate", "hit_blocks / lookup_blocks since start.", labels=["tier"]
        )
        for tier, s in stats.items():
            tokens.add_metric([tier], s["hit_blocks"] * self.block_size)
            rate.add_metric([tier], s["hit_blocks"] / max(1, s["lookup_blocks"]))
        yield tokens
        yield rate
        yield from self._usage()
        yield from self._pool()

    def _usage(self) -> Iterable[Metric]:
        usage: dict[str, dict[str, Any]] = {t.name: t.usage() for t in self.tiers}
        for key, name, doc in (
            ("bytes", "used_bytes", "Bytes the tier holds (Redis: the server's used_memory)."),
            ("capacity_bytes", "capacity_bytes", "The tier's byte cap."),
            ("entries", "entries", "Values the tier holds (Redis: the server's keys)."),
            ("up", "up", "1 while the tier is usable, 0 while down or degraded."),
        ):
            fam = GaugeMetricFamily(f"pdserve_kvpool_{name}", doc, labels=["tier"])
            for tier, u in usage.items():
                if u.get(key) is not None:
                    fam.add_metric([tier], float(u[key]))
            yield fam

    def _pool(self) -> Iterable[Metric]:
        c = self.pool_counters()
        yield GaugeMetricFamily(
            "pdserve_kvpool_chunk_blocks", "Blocks per stored value (a chunk).", c["chunk_blocks"]
        )
        yield GaugeMetricFamily(
            "pdserve_kvpool_queue_depth", "Chunks waiting in the write-back queue.", c["queued"]
        )
        yield CounterMetricFamily(
            "pdserve_kvpool_queue_drops",
            "put() calls (chunks) dropped: write-back queue full.",
            c["drops"],
        )
        yield CounterMetricFamily(
            "pdserve_kvpool_write_errors",
            "Chunks the write-back thread could not encode or write (not stored).",
            c["write_errors"],
        )
        yield CounterMetricFamily(
            "pdserve_kvpool_deadline_misses",
            "get() calls that stopped at their deadline with blocks still to load.",
            c["deadline_misses"],
        )
