"""Autobalance: move a worker between the prefill and decode pools when the mix shifts.

Pure policy: `pressures` turns the router's picture of the queues (`loads.WorkerLoad`) and the
cost model into a `PoolSample`; `Autobalancer.observe(now, sample)` returns which way to move
one worker, or None. The RouterCore samples the pools every second and performs a move with
`set_role` (drain, switch, rejoin), the same path as the admin endpoint.

Pressures are fractions of the SLO budgets: prefill = the worst P's queue over the TTFT SLO;
decode = the share of the TPOT headroom the worst D's batching uses. With no worker in a pool,
that pool's work runs on the other (whole requests), and its pressure is measured there.

Hysteresis, so it does not flap: a move needs one pool above `high` while the other is below
`low` for `sustain_s` in a row; after a move nothing moves for `cooldown_s` (the drained
worker's requests must finish and the queues settle); and a pool never drops below `min_pool`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.router.loads import WorkerLoad
from pdserve.router.slo import SloPlanner

# Without SLOs, pressure is measured against these budgets.
DEFAULT_TTFT_REF_S, DEFAULT_TPOT_REF_S = 2.0, 0.1


@dataclass(frozen=True)
class PoolSample:
    prefill_pressure: float
    decode_pressure: float
    n_prefill: int
    n_decode: int


def pressures(
    prefill: Sequence[WorkerLoad],
    decode: Sequence[WorkerLoad],
    planner: SloPlanner,
    now: float,
    n_prefill: int,
    n_decode: int,
) -> PoolSample:
    """Prefill: the worst queue among `prefill` (predicted seconds, or the measured wait of its
    oldest prompt if longer) over the TTFT SLO; decode: the worst batching cost among `decode`
    (see `sharing`)."""
    ttft_ref = planner.slo_ttft_s or DEFAULT_TTFT_REF_S
    tpot_ref = planner.slo_tpot_s or DEFAULT_TPOT_REF_S
    queued = (max(w.prefill_backlog(now), w.oldest_wait(now)) for w in prefill)
    p = max(queued, default=0.0) / ttft_ref
    d = max((sharing(w, planner, tpot_ref) for w in decode), default=0.0)
    return PoolSample(p, d, n_prefill, n_decode)


def sharing(w: WorkerLoad, planner: SloPlanner, tpot_ref: float) -> float:
    """How much of the TPOT headroom (SLO minus a lone request's step) sharing this worker's
    decode steps uses. A lone long-context request can be slow on its own; more decode
    workers would not help it, so it does not count as decode pressure."""
    batch = w.decode_streams()
    if batch <= 1:
        return 0.0
    k, ctx = planner.calibration.tpot * w.slowness, w.context_sum()
    alone = planner.model.decode_step_s(1, ctx // batch) * k
    shared = planner.model.decode_step_s(batch, ctx) * k
    return (shared - alone) / max(tpot_ref - alone, 1e-3)


@dataclass
class Autobalancer:
    high: float = 0.7
    low: float = 0.3
    sustain_s: float = 5.0
    cooldown_s: float = 20.0
    min_pool: int = 0
    _since: float | None = None  # when the current imbalance started
    _direction: str | None = None
    _last_move: float = float("-inf")
    moves: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"need 0 <= low < high, got low={self.low}, high={self.high}")
        if self.sustain_s < 0 or self.cooldown_s < 0 or self.min_pool < 0:
            raise ValueError("sustain_s, cooldown_s and min_pool must be >= 0")

    def observe(self, now: float, s: PoolSample) -> str | None:
        """'to_prefill' (a decode worker becomes prefill), 'to_decode', or None."""
        direction = self._imbalance(s)
        if direction != self._direction:
            self._direction, self._since = direction, now
        if direction is None or now - self._last_move < self.cooldown_s:
            return None
        assert self._since is not None
        if now - self._since < self.sustain_s:
            return None
        self._last_move, self._since = now, now
        self.moves += 1
        return direction

    def _imbalance(self, s: PoolSample) -> str | None:
        if s.n_prefill + s.n_decode < 2:
            return None
        if (
            s.prefill_pressure > self.high
            and s.decode_pressure < self.low
            and s.n_decode > self.min_pool
        ):
            return "to_prefill"
        if (
            s.decode_pressure > self.high
            and s.prefill_pressure < self.low
            and s.n_prefill > self.min_pool
        ):
            return "to_decode"
        return None
