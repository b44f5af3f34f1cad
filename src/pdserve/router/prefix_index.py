"""`PrefixIndex`: which prompt prefixes each worker holds in its prefix cache (pure: no sockets).

Workers push `KVEvents` (workers/worker.py): after Hello a snapshot (`cleared=True`, seq 0),
then the block hashes stored and removed, `seq` counting up by one per message. The index keeps,
per worker, the set of hashes it holds, and answers `match`: how many leading prompt tokens each
worker has cached, by hashing the prompt's full blocks exactly as the engine does
(`block_pool.hash_full_blocks`: chained sha256 from the root hash, equal in every process).

Trust: an entry is trusted from a `cleared` snapshot on, while every later message arrives in
order. A seq gap (a message lost: the worker's send queue was full, or it restarted) or a delta
for a worker with no snapshot makes the entry untrusted: `match` reports 0 for it and
`needs_resync(worker_id)` is True until the next `cleared` message, which the owner gets by
sending Hello again. The index is a routing hint, never a correctness matter: a worker always
checks its own cache, so a stale entry costs only a worse choice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.block_pool import ROOT_HASH, BlockHash, hash_full_blocks
from pdserve.workers.messages import KVEvents


@dataclass
class _WorkerEntry:
    block_size: int
    hashes: set[BlockHash] = field(default_factory=set)
    next_seq: int = 0
    trusted: bool = False


class PrefixIndex:
    def __init__(self, root_hash: BlockHash = ROOT_HASH) -> None:
        self.root_hash = root_hash
        self._workers: dict[str, _WorkerEntry] = {}
        self.gaps = 0  # seq gaps seen (each made a worker untrusted until resynced)

    # ---- feeding -------------------------------------------------------------------------------
    def apply(self, events: KVEvents) -> None:
        """Fold one KVEvents message in (see the module docstring for the trust rules)."""
        wid = events.worker_id
        entry = self._workers.get(wid)
        if events.cleared:
            entry = _WorkerEntry(events.block_size, set(events.stored), trusted=True)
            self._workers[wid] = entry
        elif entry is None or not entry.trusted:
            self._untrust(wid, events.block_size)
            return
        elif events.seq != entry.next_seq or events.block_size != entry.block_size:
            self.gaps += 1
            self._untrust(wid, events.block_size)
            return
        else:
            entry.hashes.update(events.stored)
        entry.hashes.difference_update(events.removed)
        entry.next_seq = events.seq + 1

    def _untrust(self, worker_id: str, block_size: int) -> None:
        entry = self._workers.setdefault(worker_id, _WorkerEntry(block_size))
        entry.trusted = False
        entry.hashes = set()  # stale; nothing to keep until the snapshot replaces it

    def drop(self, worker_id: str) -> None:
        """Forget a worker (gone, or restarted: its cache is empty)."""
        self._workers.pop(worker_id, None)

    def needs_resync(self, worker_id: str) -> bool:
        """True if the worker's entry cannot be trusted: ask it for a snapshot (Hello)."""
        entry = self._workers.get(worker_id)
        return entry is None or not entry.trusted

    # ---- queries -------------------------------------------------------------------------------
    def match(
        self,
        prompt_ids: Sequence[int],
        block_size: int,
        worker_ids: Iterable[str] | None = None,
    ) -> dict[str, int]:
        """Per worker, the prompt's leading tokens (whole blocks) found in its prefix cache.

        Each worker is matched at its own block size (its events carry it; workers may differ),
        `block_size` being the fallback; the prompt is hashed once per distinct size in the
        call. Untrusted or unknown workers get 0. `worker_ids=None` asks about every known one.
        """
        ids = list(self._workers) if worker_ids is None else list(worker_ids)
        by_size: dict[int, list[BlockHash]] = {}
        out: dict[str, int] = {}
        for wid in ids:
            entry = self._workers.get(wid)
            if entry is None or not entry.trusted or not entry.hashes:
                out[wid] = 0
                continue
            size = entry.block_size or block_size
            hashes = by_size.get(size)
            if hashes is None:
                hashes = by_size[size] = hash_full_blocks(prompt_ids, size, self.root_hash)
            out[wid] = _leading_run(hashes, entry.hashes) * size
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "workers": len(self._workers),
            "hashes": {wid: len(e.hashes) for wid, e in self._workers.items()},
            "untrusted": sorted(wid for wid, e in self._workers.items() if not e.trusted),
            "gaps": self.gaps,
        }


def _leading_run(hashes: list[BlockHash], held: set[BlockHash]) -> int:
    """How many of `hashes`, from the first, are all in `held`."""
    for i, h in enumerate(hashes):
        if h not in held:
            return i
    return len(hashes)
