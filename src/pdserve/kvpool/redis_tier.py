"""Shared Redis tier: one key per value, a chunk of blocks (`pdkv:` + pool key), shared by
every worker.

Redis bounds itself (`maxmemory` + `allkeys-lru`, no persistence: the server's own eviction is
this tier's LRU). Every call is one round trip: `exists` pipelines EXISTS, `get_many` MGETs
`GET_BATCH` keys at a time (checking the deadline between batches), `put_many` pipelines EXISTS
and then `SET NX` of the absent keys. Redis applies a SET only once its whole value has arrived,
so a write cut off half-way is never visible.

A dead or unreachable Redis must not stall the engine: sockets time out after `timeout_s`,
redis-py's own retries are off, and the first failure opens a breaker. While it is open, the
callers' reads (`exists`, `get_many`, `delete`) return "nothing here" at once (counted as
skipped) and never probe; only the write-back thread does - its writes and its housekeeping
`refresh` (once a second) try again every `retry_s` - and the tier is used again as soon as one
of them gets an answer. So a caller pays at most the one timeout that found Redis gone.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.kvpool.tiers import TierStats

log = logging.getLogger("pdserve.kvpool")

PREFIX = b"pdkv:"
GET_BATCH = 8  # values per MGET (8 chunks of ~2.2 MB for the default model: ~17 MB)
FAILURES = (redis.RedisError, OSError)  # down, timed out, or refusing (e.g. OOM under noeviction)
T = TypeVar("T")


class RedisTier:
    name = "redis"

    def __init__(self, url: str, timeout_s: float = 0.25, retry_s: float = 1.0) -> None:
        try:
            self.client = redis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
            )
        except ValueError as e:
            raise ValueError(f"bad --kv-pool-redis URL {url!r}: {e}") from e
        self.url, self.retry_s = url, retry_s
        self.stats = TierStats()
        self._down_until = 0.0  # monotonic; > now while the breaker is open
        self._down_since: float | None = None
        self._usage: dict[str, Any] = {"entries": None, "bytes": None, "capacity_bytes": None}
        self._lock = threading.Lock()
        self.refresh()

    # ---- the breaker ---------------------------------------------------------------------------
    def _call(self, op: str, fn: Callable[[], T], default: T, probe: bool = False) -> T:
        """fn() unless the breaker is open; `probe`: a background call that may test it."""
        down = self._down_since is not None
        if down and (not probe or time.monotonic() < self._down_until):
            self.stats.add("skipped")
            return default
        try:
            result = fn()
        except FAILURES as e:
            self._failed(op, e)
            return default
        self._up()
        return result

    def _failed(self, op: str, err: Exception) -> None:
        self.stats.add("errors")
        with self._lock:
            self._down_until = time.monotonic() + self.retry_s
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
        if first:
            log.warning("kvpool redis tier %s down (%s: %s); retrying every %.1f s",
                        self.url, op, err, self.retry_s)  # fmt: skip

    def _up(self) -> None:
        if self._down_since is not None:
            with self._lock:
                since, self._down_since = self._down_since, None
            if since is not None:
                log.warning("kvpool redis tier %s back after %.1f s", self.url,
                            time.monotonic() - since)  # fmt: skip

    @property
    def up(self) -> bool:
        return self._down_since is None

    # ---- reads ---------------------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def run() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(PREFIX + key)
            return [bool(present) for present in pipe.execute()]

        return self._call("exists", run, [False] * len(keys))

    def get_many(self, keys: Sequence[bytes], deadline: float) -> list[bytes]:
        out: list[bytes] = []
        for start in range(0, len(keys), GET_BATCH):
            if time.monotonic() > deadline:
                break
            batch = [PREFIX + k for k in keys[start : start + GET_BATCH]]
            values = self._call("mget", functools.partial(self.client.mget, batch), None)
            if values is None:
                break
            for value in values:
                if not isinstance(value, bytes):  # None: missing (decode_responses is off)
                    return out
                out.append(value)
        return out

    # ---- writes --------------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        if not items:
            return 0

        def run() -> int:
            pipe = self.client.pipeline(transaction=False)
            for key, _ in items:
                pipe.exists(PREFIX + key)
            absent = [item for item, there in zip(items, pipe.execute(), strict=True) if not there]
            self.stats.add("present", len(items) - len(absent))
            if not absent:
                return 0
            for key, value in absent:
                pipe.set(PREFIX + key, value, nx=True)
            done = [len(v) for (_, v), ok in zip(absent, pipe.execute(), strict=True) if ok]
            self.stats.add("bytes_written", sum(done))
            return len(done)

        written = self._call("set", run, 0, probe=True)
        self.stats.add("puts", written)
        return written

    def delete(self, key: bytes) -> None:
        self._call("del", lambda: self.client.delete(PREFIX + key), 0)

    # ---- state ---------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Probe a down server and refresh the usage numbers (the writer calls this each second)."""

        def run() -> dict[str, Any]:
            pipe = self.client.pipeline(transaction=False)
            pipe.info("memory")
            pipe.info("stats")
            pipe.dbsize()
            memory, stats, keys = pipe.execute()
            return {
                "entries": int(keys),
                "bytes": int(memory.get("used_memory", 0)),
                "capacity_bytes": int(memory.get("maxmemory", 0)) or None,
                # server-wide (every worker sees the same number): stats() only, not a counter
                "server_evicted_keys": int(stats.get("evicted_keys", 0)),
            }

        usage = self._call("info", run, None, probe=True)
        if usage is not None:
            self._usage = usage

    def usage(self) -> dict[str, object]:
        return {**self._usage, "up": self.up, "url": self.url}

    def close(self) -> None:
        self.client.close()
