"""`WorkerLoad`: the router's picture of one worker's queue and batch, as `Job`s (one per
request it holds: prefill owed, then decoding). Routing books each dispatch on it
(decide.py `book`), the core tells it about first tokens, deliveries and ends, and the SLO
planner (slo.py) and the autobalancer (balancer.py) read it. Pure data: no clock of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A step's tokens reach the router within a few ms of each other: the batch around them is
# counted once per this long (`WorkerLoad.tokens`), not once per token (O(batch^2) a step)
SEEN_REFRESH_S = 0.005


@dataclass
class Job:
    """One request as seen on one worker: prefill owed, then decoding (or neither)."""

    rid: str
    prefill_s: float  # predicted seconds of prefill still owed here (0 once the first token came)
    context: int  # tokens in KV when decoding here
    remaining: int  # tokens still expected from this worker's decode steps
    decodes: bool  # does this worker decode it (D, local, colocated) or only prefill (P)
    queued_at: float
    first_at: float | None = None  # first token seen (decode starts)
    generated: int = 0
    streams: int = 1  # sequences decoding (n > 1: n choices forked from one prefill)
    # its prefill's first step at the cost model's profiled threads (a whole token budget at
    # most): what a worker given every core may still be computing when a hold ends
    step_s: float = 0.0
    # the decode batch (streams, context tokens) it stepped in, summed over its tokens: what
    # the planner's calibration re-prices its TPOT at (`seen`, `SloPlanner.learn`)
    seen_streams: int = 0
    seen_context: int = 0
    seen_tokens: int = 0

    def seen(self) -> tuple[float, float] | None:
        """The mean decode batch of its tokens here: (streams, context tokens); None: none."""
        if not self.seen_tokens:
            return None
        return self.seen_streams / self.seen_tokens, self.seen_context / self.seen_tokens


@dataclass
class WorkerLoad:
    """The router's picture of one worker's queue and batch."""

    worker_id: str
    jobs: dict[str, Job] = field(default_factory=dict)
    prefill_free_at: float = 0.0  # when the prefill head-of-line started (approximation)
    # speculation here: (drafts verified, accepted) per decode request-step, from its stats
    spec: tuple[float, float] = (0.0, 0.0)
    # its step times against the cost model's: the thread mover (thread_moves.py) sets it when
    # the worker runs another thread count than the model was profiled at
    slowness: float = 1.0
    # ... and of the prefills sent here now, which may run on other threads than it runs now
    # (`threads.price`); None: `slowness`
    prefill_slowness: float | None = None
    # ... and of the decode steps of requests sent here now: a new prompt sends P to work, so
    # a D lent every core while P was idle decodes it on its `split` share (`threads.price`)
    decode_slowness: float | None = None
    # seconds this worker was told to hold its steps (`hold_decode`), and since when it is
    held_total_s: float = 0.0
    held_since: float | None = None
    # the decoding batch (streams, context tokens) last counted for `Job.seen`, and when
    _seen: tuple[int, int] = (0, 0)
    _seen_at: float = float("-inf")

    def set_held(self, held: bool, now: float) -> None:
        """The thread mover told it to hold its steps (or to run them again)."""
        if held and self.held_since is None:
            self.held_since = now
        elif not held and self.held_since is not None:
            self.held_total_s += now - self.held_since
            self.held_since = None

    def held_s(self, now: float) -> float:
        """Seconds held so far (the clock two readings of which bound a request's holds)."""
        since = self.held_since
        return self.held_total_s + (0.0 if since is None else max(0.0, now - since))

    def prefill_rate(self) -> float:
        """What the cost model's prefill times are multiplied by here."""
        return self.slowness if self.prefill_slowness is None else self.prefill_slowness

    def decode_factor(self) -> float:
        """What the cost model's decode steps are multiplied by for requests decoding here."""
        return self.slowness if self.decode_slowness is None else self.decode_slowness

    def _queue(self, now: float) -> tuple[list[Job], float]:
        """The prefills owed here in the order they run, and how long the head has run."""
        owed = sorted((j for j in self.jobs.values() if j.prefill_s > 0), key=lambda j: j.queued_at)
        if not owed:
            return owed, 0.0
        ran = max(0.0, now - max(owed[0].queued_at, self.prefill_free_at))
        return owed, min(ran, owed[0].prefill_s)

    def prefill_backlog(self, now: float) -> float:
        """Seconds of prefill queued here, minus what the head has already run."""
        owed, ran = self._queue(now)
        return sum(j.prefill_s for j in owed) - ran

    def prefill_ends(self, now: float) -> list[tuple[Job, float]]:
        """Each prefill owed here, in the order they run, with the seconds until it ends."""
        owed, ran = self._queue(now)
        ends, total = [], -ran
        for j in owed:
            total += j.prefill_s
            ends.append((j, total))
        return ends

    def prefilled_in(self, rid: str, now: float) -> float | None:
        """Seconds until the prefill of `rid` queued here ends (those queued before it run
        first), or None when none is owed here."""
        return next((t for j, t in self.prefill_ends(now) if j.rid == rid), None)

    def oldest_wait(self, now: float) -> float:
        """How long the longest-queued prompt here has waited for its first token: the
        measured side of the queue, which a worker slower than its model shows (the
        predicted backlog would not)."""
        owed = [j.queued_at for j in self.jobs.values() if j.prefill_s > 0]
        return now - min(owed) if owed else 0.0

    def decoding(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.decodes]

    def context_sum(self) -> int:
        return sum(j.context * j.streams for j in self.decoding())

    def decode_streams(self) -> int:
        """Sequences in this worker's decode batch (an n-choice request counts n)."""
        return sum(j.streams for j in self.decoding())

    # ---- events from the core ------------------------------------------------------------
    def add(self, job: Job) -> None:
        if not any(j.prefill_s > 0 for j in self.jobs.values()):
            self.prefill_free_at = job.queued_at
        self.jobs[job.rid] = job

    def first_token(self, rid: str, now: float) -> None:
        job = self.jobs.get(rid)
        if job is None or job.prefill_s == 0:
            return
        job.prefill_s, job.first_at = 0.0, now
        self.prefill_free_at = now  # the next queued prefill starts now
        if not job.decodes:
            del self.jobs[rid]

    def tokens(self, rid: str, n: int, now: float) -> None:
        job = self.jobs.get(rid)
        if job is not None and job.decodes:
            job.first_at = job.first_at or now
            streams, context = self._stepping(now)
            job.seen_streams += n * streams
            job.seen_context += n * context
            job.seen_tokens += n
            job.generated += n
            job.context += n
            job.remaining = max(1, job.remaining - n)

    def _stepping(self, now: float) -> tuple[int, int]:
        """(streams, context tokens) of the requests decoding here, counted again only when
        SEEN_REFRESH_S has passed since the last count."""
        if now - self._seen_at >= SEEN_REFRESH_S:
            stepping = [j for j in self.decoding() if j.first_at is not None]
            self._seen = (sum(j.streams for j in stepping),
                          sum(j.context * j.streams for j in stepping))  # fmt: skip
            self._seen_at = now
        return self._seen

    def remove(self, rid: str) -> tuple[float, float] | None:
        """Forget `rid` here; the mean batch it decoded in (`Job.seen`), if it decoded here."""
        job = self.jobs.pop(rid, None)
        return job.seen() if job is not None else None


def less_held(tpot: float | None, held_s: float, tokens: int) -> float | None:
    """A request's TPOT less the `held_s` seconds its decode worker held its steps meanwhile
    (`hold_decode`), what the planner's calibration learns from (None: nothing to learn)."""
    if tpot is None:
        return None
    return max(0.0, tpot - held_s / max(1, tokens - 1)) or None
