"""`TieredKVPool`: the KVPool of api.py over an ordered list of tiers (memory, disk, redis).

Every tier stores the same values: chunks of up to C = `namespace.chunk_blocks` blocks under the
key of their last block (api.py). The memory tier chunks too: one format and one run logic for
all tiers, and a lower tier's hit is promoted into memory as the very bytes it read.

Life of a chunk:
1. `put(first, hashes, kvs)` (engine thread): a chunk already in the memory tier is done; else,
   when the write-back queue has room, one CPU copy of its blocks joins the queue (the engine
   reuses its blocks as soon as put returns); when it is full the chunk is dropped and counted.
2. The write-back thread takes up to WRITE_BATCH blocks' worth of chunks, encodes each once
   (values.py) and hands the batch to every tier in order; each tier writes only the keys it
   lacks and makes each value visible whole (memory: one dict insert; disk: temp file + rename;
   Redis: SET).
3. `lookup(hashes)` asks each tier, in order, whether each candidate chunk end is stored (one
   round trip), from where the run so far may still grow: after a full chunk its end, after a
   partial one its start (a lower tier may hold the full chunk over the same start). A tier's
   run replaces what it outgrows.
4. `get(hashes, deadline)` reads the chunks of that run the same way (memory first, the rest
   from the next tier...), verifies every value (checksum, key echo, first block and count,
   shape) and stops at the first missing, late or corrupt one; a corrupt value is deleted from
   its tier and counted. Chunks found below the memory tier are promoted into it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Histogram

from pdserve.kvpool.api import (
    BlockHash,
    KVPool,
    PoolNamespace,
    check_chunk,
    check_group,
    chunk_run,
    chunk_spans,
)
from pdserve.kvpool.metrics import PoolMetrics
from pdserve.kvpool.tiers import MemoryTier, Tier
from pdserve.kvpool.values import CorruptValue, decode_value, encode_value

log = logging.getLogger("pdserve.kvpool")

WRITE_BATCH = 8  # blocks per write-back pass (at least one chunk): ~6 MB (default model)
HOUSEKEEPING_S = 1.0  # how often an idle writer refreshes tiers' usage (Redis INFO)

_Item = tuple[bytes, int, torch.Tensor]  # key, first block, chunk [blocks, layers, 2, ...]


def snapshot(kvs: Sequence[torch.Tensor]) -> torch.Tensor:
    """A private CPU copy of a chunk's blocks, stacked: the engine reuses its blocks as soon as
    put() returns.

    On CPU the copy goes through numpy (one thread): torch's own copy may fan out to its
    intra-op threads, and with the engine's threads busy on a small machine waiting for them
    took 10-15 ms per 0.7 MB block instead of 0.02 ms (measured under load on 2 cores)."""
    srcs = [kv.detach() for kv in kvs]
    if srcs[0].device.type != "cpu":
        return torch.stack(srcs).to("cpu")
    bf16 = srcs[0].dtype == torch.bfloat16
    arrs = [(src.view(torch.int16) if bf16 else src).numpy() for src in srcs]
    out = torch.from_numpy(np.stack(arrs))  # one copy into a new C-contiguous array
    return out.view(torch.bfloat16) if bf16 else out


class TieredKVPool:
    def __init__(
        self,
        namespace: PoolNamespace,
        tiers: Sequence[Tier],
        *,
        queue_size: int = 256,
        registry: CollectorRegistry | None = None,
        close_tiers: bool = True,
    ) -> None:
        """`queue_size`: the write-back queue's bound in blocks (it holds queue_size // C
        chunks, at least one); `close_tiers=False`: the tiers are shared with another pool,
        which closes them."""
        if not tiers:
            raise ValueError("a TieredKVPool needs at least one tier")
        if queue_size < 1:
            raise ValueError(f"write-back queue size must be >= 1, got {queue_size}")
        self.namespace = namespace
        self.tiers = list(tiers)
        self.memory = next((t for t in self.tiers if isinstance(t, MemoryTier)), None)
        self._queue: queue.Queue[_Item | None] = queue.Queue(
            maxsize=max(1, queue_size // namespace.chunk_blocks)
        )
        self._idle = threading.Condition()
        self._pending = 0  # enqueued and not yet written everywhere
        self._closed = False
        self._close_tiers = close_tiers
        self.drops = self.deadline_misses = self.write_errors = 0
        self.metrics = PoolMetrics(self.tiers, namespace.block_size, self._counters, registry)
        self.registry = self.metrics.registry
        self._thread = threading.Thread(target=self._write_loop, name="kvpool-writeback")
        self._thread.daemon = True  # close() joins it; daemon only so a crash cannot hang exit
        self._thread.start()

    # ---- reads ---------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash], start: int = 0) -> int:
        return self._lookup(self.namespace, hashes, start)

    def _lookup(self, ns: PoolNamespace, hashes: Sequence[BlockHash], start: int) -> int:
        keys = [ns.key(h) for h in hashes]
        c, stop = ns.chunk_blocks, start + len(keys)
        run: list[tuple[int, int, Tier]] = []  # chunks [p, e) (clipped at start), their tiers
        end = start  # blocks [start, end) covered so far
        grow = start - start % c  # the aligned block from which the run may still grow
        for tier in self.tiers:
            lo = max(grow, start)  # the first block to ask about
            if lo >= stop:
                break
            present = tier.exists(keys[lo - start :])
            tier.stats.add("lookups")
            tier.stats.add("lookup_blocks", stop - lo)
            found = chunk_run(present, lo, c)
            if not found or found[-1][1] <= end:
                continue
            run = [r for r in run if r[0] < grow] + [(max(p, start), e, tier) for p, e in found]
            p, end = found[-1]
            grow = end if end - p == c else p
        for p, e, tier in run:
            tier.stats.add("hit_blocks", e - p)
        return end - start

    def get(
        self, hashes: Sequence[BlockHash], deadline: float, start: int = 0
    ) -> list[torch.Tensor]:
        return self._get(self.namespace, hashes, deadline, start)

    def _get(
        self, ns: PoolNamespace, hashes: Sequence[BlockHash], deadline: float, start: int
    ) -> list[torch.Tensor]:
        spans = chunk_spans(start, start + len(hashes), ns.chunk_blocks)
        keys = [ns.key(hashes[e - 1 - start]) for _, e in spans]
        out: list[torch.Tensor] = []
        promote: list[tuple[bytes, bytes]] = []
        done = 0  # chunks loaded
        for tier in self.tiers:
            if done == len(keys) or time.monotonic() > deadline:
                break
            rest = keys[done:]
            t0 = time.perf_counter()
            values = tier.get_many(rest, deadline)
            n_blocks = sum(e - p for p, e in spans[done : done + len(values)])
            self._observe(self.metrics.get_seconds, tier, t0, n_blocks)
            for key, value in zip(rest, values, strict=False):
                p, e = spans[done]
                try:
                    chunk = decode_value(key, value, p, e - p)
                except CorruptValue as err:
                    self._corrupt(tier, key, err)
                    return self._finish(out, promote)
                # views of one new tensor (the caller's); blocks before `start` are dropped
                out += chunk[max(p, start) - p :].unbind(0)
                done += 1
                tier.stats.add("get_blocks", e - p)
                tier.stats.add("bytes_read", len(value))
                if tier is not self.memory:
                    promote.append((key, value))
        if done < len(keys) and time.monotonic() > deadline:
            self.deadline_misses += 1
        return self._finish(out, promote)

    def _finish(
        self, out: list[torch.Tensor], promote: list[tuple[bytes, bytes]]
    ) -> list[torch.Tensor]:
        if self.memory is not None and promote:
            self.memory.put_many(promote)
        return out

    def _corrupt(self, tier: Tier, key: bytes, err: CorruptValue) -> None:
        tier.stats.add("corrupt")
        tier.delete(key)
        log.warning(
            "kvpool %s: deleted a corrupt value (%s); its blocks are recomputed", tier.name, err
        )

    # ---- writes --------------------------------------------------------------------------------
    def put(self, first: int, hashes: Sequence[BlockHash], kvs: Sequence[torch.Tensor]) -> bool:
        return self._put(self.namespace, first, hashes, kvs)

    def _put(
        self,
        ns: PoolNamespace,
        first: int,
        hashes: Sequence[BlockHash],
        kvs: Sequence[torch.Tensor],
    ) -> bool:
        check_chunk(ns, first, hashes, len(kvs))
        for kv in kvs:
            self._check_block(kv)
        key = ns.key(hashes[-1])
        if self._closed:
            return False
        if self.memory is not None and self.memory.exists([key])[0]:
            self.memory.stats.add("present")
            return True
        if self._queue.full():
            self.drops += 1
            return False
        with self._idle:
            self._pending += 1
        try:
            self._queue.put_nowait((key, first, snapshot(kvs)))
        except queue.Full:  # another thread filled it since the check
            self.drops += 1
            self._done(1)
            return False
        return True

    def _check_block(self, kv: torch.Tensor) -> None:
        ns = self.namespace
        if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[2] != ns.block_size:
            raise ValueError(
                f"a pool block is [layers, 2, block_size={ns.block_size}, kv_heads, head_dim], "
                f"got {tuple(kv.shape)}"
            )
        if str(kv.dtype).removeprefix("torch.") != ns.dtype:
            raise ValueError(f"pool namespace holds {ns.dtype} KV, got {kv.dtype}")

    def _write_loop(self) -> None:
        last_housekeeping = time.monotonic()
        stop = False
        while not stop:
            batch: list[_Item] = []
            try:
                item = self._queue.get(timeout=HOUSEKEEPING_S)
                if item is None:
                    stop = True
                else:
                    batch.append(item)
                    stop = self._drain(batch)
            except queue.Empty:  # idle: housekeeping only
                pass
            if batch:
                try:
                    self._write(batch)
                except Exception:  # a bug must not kill the writer (puts would pile up)
                    self.write_errors += len(batch)
                    log.exception("kvpool: write-back of %d chunks failed", len(batch))
                finally:
                    self._done(len(batch))
            if time.monotonic() - last_housekeeping >= HOUSEKEEPING_S:
                self._housekeeping()
                last_housekeeping = time.monotonic()

    def _drain(self, batch: list[_Item]) -> bool:
        """Fill `batch` from the queue without waiting; True when the stop sentinel came."""
        while sum(len(kv) for _, _, kv in batch) < WRITE_BATCH:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return False
            if item is None:
                return True
            batch.append(item)
        return False

    def _write(self, batch: list[_Item]) -> None:
        items: list[tuple[bytes, bytes]] = []
        blocks: dict[bytes, int] = {}
        for key, first, kv in batch:
            try:
                items.append((key, encode_value(key, kv, first, self.namespace.codec)))
                blocks[key] = len(kv)
            except ValueError as e:  # e.g. NaN KV under a quantizing codec
                self.write_errors += 1
                log.warning("kvpool: a chunk could not be encoded (%s); not stored", e)
        for tier in self.tiers:
            if not items:
                return
            t0 = time.perf_counter()
            try:
                written = tier.put_many(items)
            except Exception:  # a tier's own failure handling missed it: keep the writer alive
                tier.stats.add("errors")
                log.exception("kvpool %s: write failed", tier.name)
                continue
            # per block: the batch's time over its blocks (written ones; a skip costs little)
            share = sum(blocks.values()) // max(1, len(items))
            self._observe(self.metrics.put_seconds, tier, t0, written * share)

    def _housekeeping(self) -> None:
        for tier in self.tiers:
            refresh = getattr(tier, "refresh", None)
            if refresh is not None:
                refresh()

    @staticmethod
    def _observe(hist: Histogram, tier: Tier, t0: float, n: int) -> None:
        if n > 0:
            per_block = (time.perf_counter() - t0) / n
            child = hist.labels(tier.name)
            for _ in range(n):
                child.observe(per_block)

    def _done(self, n: int) -> None:
        with self._idle:
            self._pending -= n
            self._idle.notify_all()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every accepted put is written (tests, benchmarks, shutdown)."""
        end = time.monotonic() + timeout
        with self._idle:
            while self._pending > 0:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def for_namespace(self, namespace: PoolNamespace) -> KVPool:
        """This pool's tiers, queue and counters under one of its KV groups' namespaces: a
        group's values differ only in their keys, chunks and layers (values.py records the
        layer count), so one write-back and one set of metrics serve every group."""
        check_group(self.namespace, namespace)
        return GroupView(self, namespace)

    # ---- state ---------------------------------------------------------------------------------
    def _counters(self) -> dict[str, int]:
        return {
            "chunk_blocks": self.namespace.chunk_blocks,
            "queued": self._queue.qsize(),
            "drops": self.drops,
            "deadline_misses": self.deadline_misses,
            "write_errors": self.write_errors,
        }

    def stats(self) -> dict[str, object]:
        tiers = {t.name: {**t.usage(), **t.stats.as_dict()} for t in self.tiers}
        ns = self.namespace
        return {
            "namespace": {"model": ns.model, "dtype": ns.dtype, "layout": ns.layout,
                          "block_size": ns.block_size, "codec": ns.codec,
                          "chunk_blocks": ns.chunk_blocks},
            "tiers": tiers,
            **self._counters(),
            "queue_capacity": self._queue.maxsize,
        }  # fmt: skip

    def close(self) -> None:
        """Write what is queued, stop the writer, close the tiers; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)  # the writer drains it, so this waits at most one batch
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            log.error("kvpool: the write-back thread did not stop within 30 s")
        if self._close_tiers:
            for tier in self.tiers:
                tier.close()
        self.metrics.close()


class GroupView:
    """`TieredKVPool.for_namespace`: the pool's reads and writes under a KV group's namespace.
    Its lifetime is the pool's: `close` leaves the pool open (its owner closes it)."""

    def __init__(self, pool: TieredKVPool, namespace: PoolNamespace) -> None:
        self.pool, self.namespace = pool, namespace

    def lookup(self, hashes: Sequence[BlockHash], start: int = 0) -> int:
        return self.pool._lookup(self.namespace, hashes, start)

    def get(
        self, hashes: Sequence[BlockHash], deadline: float, start: int = 0
    ) -> list[torch.Tensor]:
        return self.pool._get(self.namespace, hashes, deadline, start)

    def put(self, first: int, hashes: Sequence[BlockHash], kvs: Sequence[torch.Tensor]) -> bool:
        return self.pool._put(self.namespace, first, hashes, kvs)

    def for_namespace(self, namespace: PoolNamespace) -> KVPool:
        return self.pool.for_namespace(namespace)

    def flush(self, timeout: float = 10.0) -> bool:
        return self.pool.flush(timeout)

    def stats(self) -> dict[str, object]:
        return self.pool.stats()

    def close(self) -> None:
        pass
