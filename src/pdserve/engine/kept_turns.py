"""Finished turns of conversations whose KV a worker keeps for their next turn (issue 47).

A decode worker that finishes a turn of a conversation (a request carrying a conversation key)
keeps a reference on the turn's full KV blocks, prompt and answer, for `ttl_s` seconds, so that
the next turn finds its whole history in the prefix cache even while other requests churn
through memory. Pure bookkeeping over opaque items (the KV manager's blocks): which
conversation holds what since when, which entries expired, which one goes first under memory
pressure (the oldest), and the counts. The KV manager takes and drops the references.

An entry ends one of three ways, each counted: `ttl` (expired), `pressure` (memory was needed
for a running or new request: kept turns go before any request is refused or preempted) and
`replaced` (the conversation's next turn finished and is kept instead: its blocks include these).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

RELEASE_REASONS = ("ttl", "pressure", "replaced")


@dataclass
class KeptStats:
    kept: int = 0  # turns kept
    hits: int = 0  # follow-ups that arrived while their conversation's turn was kept
    released: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RELEASE_REASONS, 0))


@dataclass
class _Entry(Generic[T]):
    items: list[T]
    expires_at: float


class KeptTurns(Generic[T]):
    """Conversation key -> the items its last finished turn holds, oldest first."""

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        if ttl_s < 0:
            raise ValueError(f"conversation_ttl must be >= 0 seconds (0: off), got {ttl_s}")
        self.ttl_s, self.clock = ttl_s, clock
        self._entries: collections.OrderedDict[str, _Entry[T]] = collections.OrderedDict()
        self.stats = KeptStats()

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def num_items(self) -> int:
        return sum(len(e.items) for e in self._entries.values())

    def keep(self, key: str, items: list[T]) -> list[T]:
        """Keep `items` for `key` until its TTL; returns the items of the entry it replaces
        (the caller drops their references)."""
        old = self._entries.pop(key, None)
        self._entries[key] = _Entry(items, self.clock() + self.ttl_s)
        self.stats.kept += 1
        if old is None:
            return []
        self.stats.released["replaced"] += 1
        return old.items

    def hit(self, key: str) -> bool:
        """A follow-up of `key` arrived: whether its last turn is kept here (counted)."""
        found = key in self._entries
        self.stats.hits += found
        return found

    def expired(self) -> list[T]:
        """Items of every entry past its TTL, removed (entries expire in the order kept)."""
        now, out = self.clock(), []
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires_at > now:
                break
            del self._entries[key]
            self.stats.released["ttl"] += 1
            out.extend(entry.items)
        return out

    def pop_oldest(self) -> list[T] | None:
        """The oldest entry's items, removed because memory is needed; None when none is kept."""
        if not self._entries:
            return None
        _, entry = self._entries.popitem(last=False)
        self.stats.released["pressure"] += 1
        return entry.items

    def oldest(self) -> str | None:
        """The key of the entry `pop_oldest` would take."""
        return next(iter(self._entries), None)

    def release(self, key: str, reason: str) -> list[T]:
        """The items of `key`'s entry (none if not kept), removed for `reason` (counted)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return []
        self.stats.released[reason] += 1
        return entry.items

    def items(self) -> list[T]:
        """Every kept item, once per entry that holds it."""
        return [item for e in self._entries.values() for item in e.items]

    def clear(self) -> list[T]:
        """Every entry's items, removed (not counted: the cache is being reset)."""
        out = [item for e in self._entries.values() for item in e.items]
        self._entries.clear()
        return out
