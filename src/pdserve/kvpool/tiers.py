"""What every pool tier offers (`Tier`), its plain counters (`TierStats`), and the memory tier.

Tiers store opaque values (kvpool/values.py: one chunk of blocks each) under full pool keys; they
never decode, and know nothing of chunks (the pool turns presence into runs of blocks). Every
method is thread-safe: the engine's thread reads while the write-back thread writes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol


@dataclass
class TierStats:
    """Cumulative counters of one tier; the metrics collector and `stats()` both read these."""

    lookups: int = 0  # lookup() calls that reached this tier
    lookup_blocks: int = 0  # blocks asked of it by lookup()
    hit_blocks: int = 0  # of those, found (its part of the leading run)
    get_blocks: int = 0  # blocks read by get() and verified (in chunks: values x their blocks)
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0  # values (chunks) written
    present: int = 0  # writes skipped: the key was already there
    evictions: int = 0
    corrupt: int = 0  # values that failed verification (deleted)
    errors: int = 0  # failed operations (I/O errors, Redis down)
    skipped: int = 0  # operations not tried because the tier was down
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


class Tier(Protocol):
    name: str
    stats: TierStats

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is present; one round trip at most; all False when the tier is
        down."""
        ...

    def get_many(self, keys: Sequence[bytes], deadline: float) -> list[bytes]:
        """Values of the leading keys present, stopping at the first missing one or at the
        monotonic deadline (a remote tier may overrun it by one socket timeout)."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store the (key, value) pairs whose key is absent; each becomes visible whole or not
        at all. Returns how many were written."""
        ...

    def delete(self, key: bytes) -> None: ...

    def usage(self) -> dict[str, object]:
        """entries, bytes, capacity_bytes (None: bounded elsewhere), up."""
        ...

    def close(self) -> None: ...


class MemoryTier:
    """Host memory: an LRU of values bounded in bytes, private to this process."""

    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"memory tier capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.stats = TierStats()
        self._values: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._values for key in keys]

    def get_many(self, keys: Sequence[bytes], deadline: float) -> list[bytes]:
        out: list[bytes] = []
        with self._lock:
            for key in keys:
                value = self._values.get(key)
                if value is None or time.monotonic() > deadline:
                    break
                self._values.move_to_end(key)
                out.append(value)
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        written = 0
        with self._lock:
            for key, value in items:
                if key in self._values:
                    self._values.move_to_end(key)
                    self.stats.add("present")
                    continue
                if len(value) > self.capacity:
                    continue
                self._evict_for(len(value))
                self._values[key] = value
                self._bytes += len(value)
                written += 1
                self.stats.add("bytes_written", len(value))
        self.stats.add("puts", written)
        return written

    def _evict_for(self, size: int) -> None:
        while self._values and self._bytes + size > self.capacity:
            _, old = self._values.popitem(last=False)
            self._bytes -= len(old)
            self.stats.add("evictions")

    def delete(self, key: bytes) -> None:
        with self._lock:
            old = self._values.pop(key, None)
            if old is not None:
                self._bytes -= len(old)

    def usage(self) -> dict[str, object]:
        with self._lock:
            return {
                "entries": len(self._values),
                "bytes": self._bytes,
                "capacity_bytes": self.capacity,
                "up": True,
            }

    def close(self) -> None:
        with self._lock:
            self._values.clear()
            self._bytes = 0
