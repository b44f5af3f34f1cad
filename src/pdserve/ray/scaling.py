"""Grow a saturated pool while the cluster has room; shrink an idle one back (`--autobalance`
under `--ray`). Pure policy over the router's pool pressures (router/balancer.py's PoolSample),
with the role-switching autobalancer's thresholds and hysteresis: a change needs its condition
for `sustain_s` in a row, then nothing changes for `cooldown_s`.

  grow P    prefill pressure > high, and the cluster has room for one more P
  grow D    decode pressure > high, and room for one more D
  shrink    a pool grown beyond its start size whose pressure stays at or below `idle`

A pool never grows past its `ceiling` (when given): more workers than a deployment was sized for
would take memory or licences it does not have, and a test can bound what it waits for.

Without room the role-switching autobalancer (router/roles.py) may still move a worker from the
other pool; with room, growing comes first (it takes nothing from the other pool).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.router.balancer import PoolSample

POOLS = ("prefill", "decode")


@dataclass
class PoolAutoscaler:
    floor: dict[str, int]  # the start sizes: never shrunk below
    ceiling: dict[str, int] = field(default_factory=dict)  # never grown past (absent: no cap)
    high: float = 0.7
    idle: float = 0.05
    sustain_s: float = 5.0
    cooldown_s: float = 20.0
    _since: dict[tuple[str, str], float] = field(default_factory=dict)
    _last: float = float("-inf")
    changes: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.idle < self.high:
            raise ValueError(f"need 0 <= idle < high, got idle={self.idle}, high={self.high}")
        if self.sustain_s < 0 or self.cooldown_s < 0:
            raise ValueError("sustain_s and cooldown_s must be >= 0")
        for role, cap in self.ceiling.items():
            if cap < self.floor.get(role, 0):
                raise ValueError(f"{role}: ceiling {cap} is below the floor {self.floor[role]}")

    def observe(
        self, now: float, s: PoolSample, room: Mapping[str, bool]
    ) -> tuple[str, str] | None:
        """("grow" | "shrink", "prefill" | "decode"), or None."""
        pressure = {"prefill": s.prefill_pressure, "decode": s.decode_pressure}
        size = {"prefill": s.n_prefill, "decode": s.n_decode}
        wanted = set()
        for role in POOLS:
            capped = size[role] >= self.ceiling.get(role, size[role] + 1)
            if pressure[role] > self.high and room.get(role, False) and not capped:
                wanted.add(("grow", role))
            elif pressure[role] <= self.idle and size[role] > self.floor.get(role, 0):
                wanted.add(("shrink", role))
        for key in list(self._since):  # a condition that lapsed starts over
            if key not in wanted:
                del self._since[key]
        for key in wanted:
            self._since.setdefault(key, now)
        if now - self._last < self.cooldown_s:
            return None
        ready = [k for k in sorted(wanted) if now - self._since[k] >= self.sustain_s]
        if not ready:
            return None
        move = ready[0]  # "grow" sorts before "shrink"
        self._last = now
        self._since.clear()
        self.changes += 1
        return move
