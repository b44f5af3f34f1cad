"""Local disk tier: one file per value (a chunk of blocks), under a byte cap with LRU eviction.

Files live at `ROOT/<namespace digest>/<2 hex>/<key hex>.kv`; a value is written to
`<name>.<pid>.<thread>.tmp` and renamed, so a reader sees a whole file or none (a crash leaves
only a `.tmp`, removed at the next start). The in-process index (key -> size, in LRU order) is
rebuilt from the directory at start, so the tier survives a worker restart; it answers
`exists` without a system call for what it knows, and one `stat` for each key it does not (a
file another worker on this host wrote into the same directory is adopted into the index; most
keys a lookup asks about are not chunk ends, so a long prompt costs ~one stat per block).
Workers sharing a directory each keep the cap by their own count and may evict each other's
files; a reader that loses the race finds no file and stops its run (the caller recomputes).
No fsync: a file torn by a power loss fails its checksum and is deleted when read.

Disk full (or any other write error, e.g. a read-only directory) degrades the tier: it logs one
error, counts it, and from then on answers as an empty tier that stores nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from pdserve.kvpool.tiers import TierStats

log = logging.getLogger("pdserve.kvpool")

SUFFIX = ".kv"
STALE_TMP_S = 60.0  # a .tmp this old belongs to no live writer


class DiskTier:
    name = "disk"

    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be > 0 bytes, got {capacity_bytes}")
        self.root = Path(root)
        self.capacity = capacity_bytes
        self.stats = TierStats()
        self.failed: str | None = None  # why the tier degraded to nothing
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as e:
            self._degrade(e)

    def path(self, key: bytes) -> Path:
        hexkey = key.hex()
        return self.root / hexkey[:32] / hexkey[32:34] / (hexkey + SUFFIX)

    def _scan(self) -> None:
        """Index the values a previous run left (oldest first); drop stale partial writes."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        for path in self.root.glob("*/*/*"):
            try:
                st = path.stat()
            except FileNotFoundError:  # another process removed it meanwhile
                continue
            if path.name.endswith(".tmp"):
                if now - st.st_mtime > STALE_TMP_S:
                    path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX:
                try:
                    found.append((st.st_mtime, bytes.fromhex(path.stem), st.st_size))
                except ValueError:  # not ours
                    continue
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        self._evict_for(0)

    def _degrade(self, err: OSError) -> None:
        self.stats.add("errors")
        if self.failed is None:
            self.failed = f"{type(err).__name__}: {err}"
            log.error("kvpool disk tier at %s disabled (%s); running without it", self.root, err)

    # ---- reads ---------------------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if self.failed is not None:
            self.stats.add("skipped")
            return [False] * len(keys)
        return [self._known(key) for key in keys]

    def _known(self, key: bytes) -> bool:
        """In the index, or a file another process on this host wrote (then adopted: one stat
        per miss, so workers sharing a directory share its values)."""
        with self._lock:
            if key in self._index:
                return True
        try:
            size = self.path(key).stat().st_size
        except OSError:
            return False
        with self._lock:
            if key not in self._index:
                self._evict_for(size)
                self._index[key] = size
                self._bytes += size
        return True

    def get_many(self, keys: Sequence[bytes], deadline: float) -> list[bytes]:
        if self.failed is not None:
            self.stats.add("skipped")
            return []
        out: list[bytes] = []
        for key in keys:
            if time.monotonic() > deadline or not self._known(key):
                break
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
            try:
                out.append(self.path(key).read_bytes())
            except FileNotFoundError:  # removed behind our back (or evicted meanwhile)
                self._forget(key)
                break
            except OSError as e:
                self.stats.add("errors")
                log.warning("kvpool disk tier: read failed: %s", e)
                break
        return out

    # ---- writes --------------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        if self.failed is not None:
            self.stats.add("skipped")
            return 0
        written = 0
        for key, value in items:
            if self._known(key):
                self.stats.add("present")
                continue
            with self._lock:
                if len(value) > self.capacity:
                    continue
                self._evict_for(len(value))
            try:
                self._write(key, value)
            except OSError as e:
                self._degrade(e)
                break
            with self._lock:
                self._index[key] = len(value)
                self._bytes += len(value)
            written += 1
            self.stats.add("bytes_written", len(value))
        self.stats.add("puts", written)
        return written

    def _write(self, key: bytes, value: bytes) -> None:
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, path)  # atomic: readers see the whole value or no file
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _evict_for(self, size: int) -> None:
        """Called with the lock held."""
        while self._index and self._bytes + size > self.capacity:
            key, old = self._index.popitem(last=False)
            self._bytes -= old
            self.path(key).unlink(missing_ok=True)
            self.stats.add("evictions")

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    def delete(self, key: bytes) -> None:
        self._forget(key)
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as e:
            self.stats.add("errors")
            log.warning("kvpool disk tier: could not delete %s: %s", self.path(key), e)

    def usage(self) -> dict[str, object]:
        with self._lock:
            return {
                "entries": len(self._index),
                "bytes": self._bytes,
                "capacity_bytes": self.capacity,
                "up": self.failed is None,
                "dir": str(self.root),
                "failed": self.failed,
            }

    def close(self) -> None:
        """The files stay: the next run (or worker) on this host starts warm."""
