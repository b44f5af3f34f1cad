"""Cores that move between P and D on one host: how many torch threads each worker runs.

Pure policy: `ThreadPolicy.observe(now, sample)` turns the pools' pressures (the autobalancer's
`PoolSample`, balancer.py) and whether each pool has any work into a target thread count per
worker; `handover` says which of those targets to send now. The router's `ThreadMover`
(thread_moves.py) samples every `interval_s`, sends `SetThreads` and counts each move; the
simulator runs the same policy.

The host's `cores` are split between the prefill pool and the decode pool (each worker at least
one thread, or held), in one of four states:

    split        both pools have work: P gets `p_cores`, D the rest
    hold_decode  both have work, P cannot grow in `split` (its share is all but D's last cores)
                 and D's running requests have TPOT slack: D holds its steps (target 0: the
                 worker keeps receiving KV but runs no step) and P prefills on every core.
                 Two processes on the same cores are no substitute: a 2-thread P beside a
                 1-thread D on 2 cores prefilled slower than a 1-thread P (measured, OpenMP's
                 barriers wait for a preempted thread), so the cores take turns instead, as
                 the colocated form's steps do. D resumes (`split`) when its slack falls under
                 `hold_reserve_s` and holds again only above twice that
    lend_decode  P has had nothing to do for `park_after_s`: P parks at one thread each, D gets
                 every core (a parked worker's thread sleeps in its poll: it uses no core)
    lend_prefill D has had nothing to do for `park_after_s`: D parks, P gets every core, also
                 while P is idle: every request starts with a prefill, and a prompt's step
                 runs on the threads it started with (one step can be the whole prompt)

`decode_slack` is the least, over D's decoding requests, of the TPOT SLO's time for their tokens
minus the time they have decoded and the steps they still need: what a pause costs nobody. A
request D prefills itself leaves no slack (its TTFT runs); one P has not sent a first token for
does not count (its TPOT has not started).

A parked pool that gets work returns to `split` at the next sample (no sustain; the router
samples when it dispatches a prompt): the host runs one thread more than it has cores for at
most one sample interval plus one engine step, the bounded hand-over (`step_tokens`: a worker
short of the host's cores steps `grain_tokens`, one with them all its whole budget, which a
hold's reserve covers). In `split`, `p_cores` moves one core at a time, with hysteresis so it
does not flap: a core moves to P when P's queue is over `high` of the TTFT SLO while D's TPOT
headroom use is under `low` (D has slack), and back to D as soon as D's is over `high` (decode
first: the tokens of running requests are late at once, a queued prompt still has its TTFT
budget); either must hold for `sustain_s`, and after a move nothing moves for `cooldown_s`.

`handover`: shrinking workers are told first; a growing worker gets its new count only once no
worker is above its target any more, so in `split` the host never runs more threads than cores;
a hold's (D told 0) grow goes with it, the two overlapping for at most D's step in progress.

`price`: the planner learns, each sample, the threads a prompt sent to each worker would
prefill on (`prefill_threads`), which differ from those it runs now.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.costmodel.capacity import speedup
from pdserve.router import balancer
from pdserve.router.balancer import PoolSample
from pdserve.router.loads import WorkerLoad
from pdserve.router.slo import SloPlanner

STATES = ("split", "lend_decode", "lend_prefill", "hold_decode")
BUSY_TAU_S = 20.0  # time constant of P's busy share (`ThreadPolicy.prefill_busy`): ~an answer


@dataclass(frozen=True)
class ThreadSample:
    pools: PoolSample  # pressures: P's queue over the TTFT SLO, D's share of its TPOT headroom
    prefill: Sequence[str]  # worker ids of the prefill pool
    decode: Sequence[str]
    prefill_idle: bool  # no prompt queued or computing on any P
    decode_idle: bool  # nothing decoding or prefilling on any D (waiting for P's KV is idle)
    decode_slack_s: float = 0.0  # how long D's decoding could pause within TPOT (`decode_slack`)
    # P's longest prompt step owed at the profile's threads (`Job.step_s`): with every core P
    # may run a whole budget as one step, which a hold must outlast
    prefill_step_s: float = 0.0


def sample(
    prefill: Mapping[str, WorkerLoad],
    decode: Mapping[str, WorkerLoad],
    planner: SloPlanner,
    now: float,
    resume_slowness: float = 0.0,
) -> ThreadSample:
    """The policy's input from the router's picture of each pool's workers (the real router's
    ThreadMover and the simulator both build it here); `resume_slowness`: D's steps after a
    hold against the profile's (`ThreadPolicy.resume_slowness`)."""
    p, d = list(prefill.values()), list(decode.values())
    return ThreadSample(
        balancer.pressures(p, d, planner, now, len(p), len(d)),
        list(prefill),
        list(decode),
        prefill_idle=not any(j.prefill_s > 0 for w in p for j in w.jobs.values()),
        # a request routed P -> D sits on D from dispatch, but D has nothing to do until its
        # first token: counting it busy split the cores while P computed the very prompt D
        # waits for, and P finished it on one thread
        decode_idle=not any(
            j.prefill_s > 0 or j.first_at is not None for w in d for j in w.jobs.values()
        ),
        decode_slack_s=decode_slack(d, planner, now, resume_slowness),
        prefill_step_s=max(
            (j.step_s for w in p for j in w.jobs.values() if j.prefill_s > 0), default=0.0
        ),
    )


def decode_slack(
    decode: Sequence[WorkerLoad], planner: SloPlanner, now: float, resume_slowness: float = 0.0
) -> float:
    """Seconds every D could hold its steps with each decoding request still within the TPOT
    SLO: per request, its SLO time for all its tokens less the time since its first token here
    and its remaining steps at the worker's predicted step, on the slower of its threads now
    and those it resumes on (`resume_slowness`) (inf: nothing decoding; 0: no TPOT SLO, or a D
    prefilling a prompt itself)."""
    if planner.slo_tpot_s is None:
        return 0.0
    slack = math.inf
    # at the rate of the last arrivals, a burst's: a hold is the first thing a burst spends,
    # and at the rate over the answer's length (as admission prices it) the first request of
    # a four-prompt burst decoded at 103 ms a token against the 100 ms SLO
    rate = planner.arrival_rate() / max(1, len(decode))  # requests a second reaching each D
    for w in decode:
        if any(j.prefill_s > 0 for j in w.jobs.values()):
            return 0.0
        batch, ctx = w.decode_streams(), w.context_sum()
        # the model's step (the planner's TPOT calibration is for whole-request predictions).
        # A hold ends in `split`: priced at D's threads of the moment (every core while P was
        # idle), its remaining steps looked up to 1.6x faster than they would run after it
        slow = max(w.slowness, resume_slowness)
        step = planner.model.decode_step_s(max(1, batch), ctx) * slow
        per_stream = ctx // max(1, batch)
        for j in w.decoding():
            tokens = j.generated + j.remaining
            if tokens < 2 or j.first_at is None:
                # P has not sent its first token: its TPOT has not started, and the prefill a
                # hold speeds up is the one it waits for (counted at its full budget, a prompt
                # with a 4-token answer left D 0.26 s of slack and P prefilled it on one thread)
                continue
            # waiting for P's KV: its clock started at P's first token, a transfer ago. Its
            # steps left also carry the requests that join D meanwhile (`SloPlanner.joining`):
            # at the batch of the moment, holds spent the slack the next arrivals needed, and
            # admission refused them to protect requests left 1 s from their TPOT SLO
            left = j.remaining * step
            left += j.remaining * planner.joining(batch, ctx, per_stream, rate, left) * slow
            slack = min(slack, planner.slo_tpot_s * (tokens - 1) - (now - j.first_at) - left)
    return slack


@dataclass
class ThreadPolicy:
    cores: int
    high: float = 0.7
    low: float = 0.3
    sustain_s: float = 1.0
    cooldown_s: float = 2.0
    park_after_s: float = 0.5
    # D holds (`hold_decode`) while its slack is over this, resumes under it, and holds again
    # only above twice it; it covers a sample interval, P's step in progress and the hand-over
    hold_reserve_s: float = 1.0
    # a worker short of the host's cores steps at most this many tokens, so cores moving to it
    # apply within ~0.3 s; with every core it runs its engine's own budget (a lone 2000-token
    # prompt in 256-token steps took 1.12-1.25x the colocated worker's time, in one 1.01-1.02x)
    grain_tokens: int = 256
    p_cores: int | None = None  # P's share in `split`; None: half the cores (rounded down)
    # the threads the planner's cost model was profiled at: predictions scale from it
    profiled_threads: int = 1
    state: str = "split"
    moves: int = 0  # changes of the targets (state changes and one-core moves)
    _want: str | None = None  # the one-core move under way in `split`: to_prefill | to_decode
    _want_since: float = 0.0
    # P's busy share of the recent past (time-weighted over BUSY_TAU_S; 1 until samples say
    # otherwise): the part of an answer D decodes on its `split` share (`price`)
    prefill_busy: float = 1.0
    _busy_at: float | None = None
    _idle_since: dict[str, float] = field(default_factory=dict)  # pool -> when it went idle
    _last_move: float = float("-inf")

    def __post_init__(self) -> None:
        if self.cores < 2:
            raise ValueError(f"moving threads needs at least 2 cores, got {self.cores}")
        if not 0 <= self.low < self.high:
            raise ValueError(f"need 0 <= low < high, got low={self.low}, high={self.high}")
        if min(self.sustain_s, self.cooldown_s, self.park_after_s, self.hold_reserve_s) < 0:
            raise ValueError("sustain_s, cooldown_s, park_after_s, hold_reserve_s must be >= 0")
        if self.grain_tokens < 1:
            raise ValueError(f"grain_tokens must be >= 1, got {self.grain_tokens}")
        if self.p_cores is None:
            self.p_cores = self.cores // 2

    def observe(self, now: float, s: ThreadSample) -> dict[str, int]:
        """Target threads of every worker in `s`'s pools."""
        n_p, n_d = len(s.prefill), len(s.decode)
        if n_p + n_d > self.cores:
            raise ValueError(f"{n_p + n_d} workers need at least as many cores, have {self.cores}")
        self.p_cores = self._p_split(n_p, n_d)
        if self._busy_at is not None and now > self._busy_at:
            a = 1.0 - math.exp(-(now - self._busy_at) / BUSY_TAU_S)
            self.prefill_busy += a * (float(not s.prefill_idle) - self.prefill_busy)
        self._busy_at = now
        state = self._state(now, s)
        if state != self.state:
            self.state, self.moves, self._want = state, self.moves + 1, None
        if state == "split":
            self._split_move(now, s, n_p, n_d)
        if state == "hold_decode":
            return {**share(s.prefill, self.cores), **{w: 0 for w in s.decode}}
        p = {"split": self.p_cores, "lend_decode": n_p, "lend_prefill": self.cores}[state]
        d = {"split": self.cores - self.p_cores, "lend_decode": self.cores, "lend_prefill": n_d}
        return {**share(s.prefill, p), **share(s.decode, d[state])}

    def expected_decode_slowness(self, n_p: int, n_d: int) -> float:
        """Each D's mean step time over an answer against the profile's: its `split` share
        while P prefills (`prefill_busy` of the time), every core while P is idle."""
        lent = slowness(max(1, self.cores // max(1, n_d)), self.profiled_threads)
        busy = self.prefill_busy
        return busy * self.resume_slowness(n_p, n_d) + (1.0 - busy) * lent

    def resume_slowness(self, n_p: int, n_d: int) -> float:
        """Each D's step time in `split` (where a hold ends) against the profile's."""
        p = self._p_split(n_p, n_d)
        return slowness(max(1, (self.cores - p) // max(1, n_d)), self.profiled_threads)

    def split_share(self, s: ThreadSample) -> int:
        """P's cores in `split` for `s`'s pools."""
        return self._p_split(len(s.prefill), len(s.decode))

    def _p_split(self, n_p: int, n_d: int) -> int:
        assert self.p_cores is not None
        return min(max(self.p_cores, n_p), self.cores - n_d)

    def prefill_threads(self, s: ThreadSample) -> dict[str, int]:
        """Per worker, the threads a prompt sent to it now would prefill on, which under this
        policy are not the threads it runs now: P, parked at one thread beside a busy D, gets
        every core once it prefills (D holds within its slack, or lends its cores when idle);
        a D prefilling a prompt itself has no slack to hold within, so it keeps its `split`
        share (and P drops to its own). The planner prices prefills at these (`price`)."""
        n_d = len(s.decode)
        p_split = self.split_share(s)
        can_hold = p_split >= self.cores - n_d and s.decode_slack_s > self._reserve(s)
        p = self.cores if s.decode_idle or can_hold else p_split
        d = self.cores if s.prefill_idle else self.cores - p_split
        return {**share(s.prefill, p), **share(s.decode, d)}

    def _state(self, now: float, s: ThreadSample) -> str:
        p_idle = self._idle_for(now, "prefill", s.prefill_idle and bool(s.decode))
        d_idle = self._idle_for(now, "decode", s.decode_idle and bool(s.prefill))
        if p_idle >= self.park_after_s and not s.decode_idle:
            return "lend_decode"
        if d_idle >= self.park_after_s:  # P busy, or both idle: a request starts with a prefill
            return "lend_prefill"
        if self._hold(s):
            return "hold_decode"
        return "split"

    def _hold(self, s: ThreadSample) -> bool:
        """Both pools busy: does D hold its steps so P prefills on every core?"""
        assert self.p_cores is not None
        if s.prefill_idle or s.decode_idle or self.p_cores < self.cores - len(s.decode):
            return False  # P idle, D idle (a lend), or `split` can still give P a core
        return s.decode_slack_s > self._reserve(s)

    def _reserve(self, s: ThreadSample) -> float:
        """The slack a hold needs: the reserve (twice it to start one, so holds do not flap)
        and P's step in progress, up to a whole budget on every core (priced at every core,
        not at P's threads of the moment: those depend on the hold)."""
        step = s.prefill_step_s * slowness(self.cores, self.profiled_threads)
        return self.hold_reserve_s * (1 if self.state == "hold_decode" else 2) + step

    def step_tokens(self, targets: Mapping[str, int]) -> dict[str, int]:
        """Each worker's step cap for its target count (`SetThreads.step_tokens`): the grain
        while it is short of the host's cores, its own budget (0) once it has them all."""
        return {w: 0 if n >= self.cores else self.grain_tokens for w, n in targets.items()}

    def _idle_for(self, now: float, pool: str, idle: bool) -> float:
        if not idle:
            self._idle_since.pop(pool, None)
            return -1.0
        return now - self._idle_since.setdefault(pool, now)

    def _split_move(self, now: float, s: ThreadSample, n_p: int, n_d: int) -> None:
        assert self.p_cores is not None
        want = self._direction(s.pools, n_p, n_d)
        if want != self._want:
            self._want, self._want_since = want, now
        if want is None or now - self._last_move < self.cooldown_s:
            return
        if now - self._want_since < self.sustain_s:
            return
        self.p_cores += 1 if want == "to_prefill" else -1
        self._last_move, self._want_since, self.moves = now, now, self.moves + 1

    def _direction(self, pools: PoolSample, n_p: int, n_d: int) -> str | None:
        assert self.p_cores is not None
        if pools.decode_pressure > self.high and self.p_cores > n_p:
            return "to_decode"
        d_has_slack = pools.decode_pressure < self.low
        if pools.prefill_pressure > self.high and d_has_slack and self.p_cores < self.cores - n_d:
            return "to_prefill"
        return None


def price(
    policy: ThreadPolicy, s: ThreadSample, loads: Mapping[str, WorkerLoad], planner: SloPlanner
) -> None:
    """Tell the planner what moving threads does to prefills and decodes: each worker's
    prefills at the threads it would run them on (`WorkerLoad.prefill_slowness`,
    `prefill_threads`), D's decode steps at its `split` share for the part of an answer P is
    busy and at every core for the rest (`decode_slowness`, `expected_decode_slowness`), and
    per P
    how much slower its queue runs while a D prefills a prompt itself (`SloPlanner.coupled`:
    D's slack is gone, so P loses the cores D's hold lent it). Priced at the threads of the
    moment, a burst went wrong (the seeds' case, three 2000-token prompts in 0.1 s): P, parked
    at one thread, looked too slow for the second prompt, D, lent both cores, fast enough; D
    took two prompts on one thread beside its decodes (TTFT 11.8 and 22.9 s) and P's own
    prompt ran on one thread too."""
    busy, base = policy.prefill_threads(s), policy.profiled_threads
    for wid, n in busy.items():
        if wid in loads:
            loads[wid].prefill_slowness = slowness(n, base)
    # Not the slower of D's threads now and its `split` share, as before: with prompts in
    # 0.5-1.1 s (bf16 rows) P was idle most of an answer, D decoded on both cores at 38-68 ms
    # a token, and admission refused requests predicted at over 100 ms on one
    expected = policy.expected_decode_slowness(len(s.prefill), len(s.decode))
    for wid in s.decode:
        if wid in loads:
            loads[wid].decode_slowness = expected
    planner.coupled = {
        w: slowness(n, base) / slowness(busy[w], base)
        for w, n in share(s.prefill, policy.split_share(s)).items()
        if w in loads and busy[w] > n
    }


def slowness(threads: int, profiled: int) -> float:
    """Step time on `threads` threads against the profile's (`capacity.speedup`'s scaling): what
    the planner multiplies its predictions for that worker by (`WorkerLoad.slowness`)."""
    return speedup(profiled) / speedup(max(1, threads))


def share(workers: Sequence[str], cores: int) -> dict[str, int]:
    """`cores` shared out over `workers`, the first ones getting the remainder, each at least 1."""
    n = len(workers)
    if n == 0:
        return {}
    base, extra = divmod(max(cores, n), n)
    return {w: base + (1 if i < extra else 0) for i, w in enumerate(workers)}


def handover(current: Mapping[str, int], targets: Mapping[str, int]) -> dict[str, int]:
    """The `SetThreads` to send now: every shrink; the grows once no worker is above its
    target (the shrinks have been applied), so the cores are freed before they are taken.

    Except behind a hold: a worker told 0 frees its cores when its step in progress ends (a D's
    decode step, tens of ms), and the worker growing into them (P, with a prompt just sent) would
    otherwise wait for that acknowledgement and the next sample, starting the prompt's first
    chunk on its old count (256 tokens on one thread: about 1 s of the seeds' 2000-token prompt,
    half of it lost)."""
    changes = {w: n for w, n in targets.items() if current.get(w) != n}
    shrinking = [w for w, n in targets.items() if current.get(w, 0) > n]
    if shrinking and any(targets[w] > 0 for w in shrinking):
        return {w: n for w, n in changes.items() if w in shrinking}
    return {**{w: changes[w] for w in shrinking}, **changes}  # the hold is sent first
