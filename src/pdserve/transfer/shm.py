"""Shared memory for the `shm` transport (transfer/transports.py): the sender writes each
frame's payload once into a ring it owns (`ShmRing`), the receiver maps the ring by name and
reads the payload in place (`ShmReader`); only the frame header and the ring position travel
over the socket. A request's ring space is released when its hand-off ends (`KVSender.done`);
when the ring is full a frame goes inline over the socket instead (counted, never silent).
"""

from __future__ import annotations

import collections
import struct
from collections.abc import Sequence
from multiprocessing import resource_tracker, shared_memory

_SHM_REF = struct.Struct("<QQ")  # offset, length; followed by the segment name


class ShmRing:
    """Sender side of `shm`: a ring of shared memory, space released per request."""

    def __init__(self, size: int) -> None:
        # size 0: no segment at all, every frame goes inline (tests of the fallback use it).
        self.shm = shared_memory.SharedMemory(create=True, size=size) if size > 0 else None
        self.size = size
        self.head = 0  # next write position
        self.regions: collections.deque[tuple[int, int, str]] = collections.deque()
        self.released: set[str] = set()

    def put(self, rid: str, parts: Sequence[bytes | memoryview]) -> bytes | None:
        """Copy `parts` into the ring; returns the reference to send, or None when full."""
        n = sum(memoryview(p).nbytes for p in parts)
        start = self._allocate(n)
        if start is None:
            return None
        pos = start
        assert self.shm is not None and self.shm.buf is not None
        buf = self.shm.buf
        for p in parts:
            view = memoryview(p).cast("B")
            buf[pos : pos + view.nbytes] = view
            pos += view.nbytes
        self.regions.append((start, start + n, rid))
        return _SHM_REF.pack(start, n) + self.shm.name.encode()

    def _allocate(self, n: int) -> int | None:
        if n == 0 or n > self.size:
            return None
        if not self.regions:
            self.head = 0
            return self._claim(0, n)
        tail = self.regions[0][0]
        if self.head > tail:  # not wrapped: free space is [head, size) and [0, tail)
            if self.size - self.head >= n:
                return self._claim(self.head, n)
            return self._claim(0, n) if tail >= n else None
        return self._claim(self.head, n) if tail - self.head >= n else None

    def _claim(self, start: int, n: int) -> int:
        self.head = start + n
        return start

    def release(self, rid: str) -> None:
        self.released.add(rid)
        while self.regions and self.regions[0][2] in self.released:
            self.regions.popleft()
        live = {r[2] for r in self.regions}
        self.released &= live

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()


class ShmReader:
    """Receiver side of `shm`: maps senders' rings by name and hands out views of payloads."""

    def __init__(self) -> None:
        self.segments: dict[str, shared_memory.SharedMemory] = {}

    def view(self, ref: bytes, max_len: int) -> memoryview:
        if len(ref) <= _SHM_REF.size or len(ref) > _SHM_REF.size + 255:
            raise ValueError("malformed shared-memory reference")
        start, n = _SHM_REF.unpack_from(ref)
        name = ref[_SHM_REF.size :].decode("ascii", errors="strict")
        seg = self._segment(name)
        if n > max_len or start + n > seg.size:
            raise ValueError(f"shared-memory range {start}+{n} outside the segment or too large")
        assert seg.buf is not None
        return seg.buf[start : start + n]

    def _segment(self, name: str) -> shared_memory.SharedMemory:
        seg = self.segments.get(name)
        if seg is None:
            seg = shared_memory.SharedMemory(name=name)
            # The sender owns and unlinks it; stop this process's tracker from doing so too.
            resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
            self.segments[name] = seg
        return seg

    def close(self) -> None:
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()
