"""Request timelines: the event vocabulary, keeping finished requests' timelines, rendering them
for people, and scoring the planner's predictions against what happened.

A timeline is a list of `(event, worker, time.monotonic())`. Event names are the `Ev` members
(plain strings, so a timeline is still JSON and tuples compare as before), some with a detail
(`route: remote`, `worker_down: stuck`, built by `labelled`), plus the workers' own stage stamps
`side:stage` (`send:first_token`, `recv:done`, built by `staged`). Readers (cluster, chaos,
metrics, bench) test events with `Ev`/`Side` and `kind_of`, never by spelling the strings.

This module imports nothing from the router at run time, so metrics and bench may import it.
"""

from __future__ import annotations

import collections
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.router.events import RouterEvents
    from pdserve.router.flight import Flight
    from pdserve.router.slo import SloPlanner

TIMELINE_KEEP = 2000  # finished requests whose timelines stay queryable

Event = tuple[str, str, float]  # (event, worker or detail, time.monotonic())


class Ev(StrEnum):
    """Events the router stamps itself."""

    ARRIVE = "arrive"
    DISPATCH = "dispatch"  # worker field: "attempt N"
    ROUTE = "route"  # labelled with the route kind; worker field: "P->D" or the one worker
    FIRST_TOKEN = "first_token"  # per worker: P's hand-off tokens, then D's
    LOCAL_FALLBACK = "local_fallback"
    RECOMPUTE = "recompute"
    REJECTED = "rejected"  # labelled with the reason
    FAILED = "failed"  # labelled with the worker's reason
    WORKER_DOWN = "worker_down"  # labelled with no_heartbeat | stuck
    # the KV pool (issue 15), from the prefilling worker's report: labelled with token counts
    POOL_LOOKUP = "pool_lookup"  # tokens the pool held after the worker's own prefix cache
    POOL_LOAD = "pool_load"  # tokens loaded of those (the rest were recomputed)
    RECOVERED_FROM_POOL = "recovered_from_pool"  # a recovery: tokens loaded vs recomputed
    # how the request ended (the outcome)
    FINISH = "finish"
    ABORTED = "aborted"
    ERROR = "error"


class Side(StrEnum):
    """Whose stage stamp: P's sender, D's receiver, or a whole request on one worker."""

    SEND = "send"
    RECV = "recv"
    LOCAL = "local"


class Stage(StrEnum):
    """Stage names in the human timeline (`RouterCore.timeline`, GET /v1/requests/{id}/timeline)."""

    QUEUE = "queue"
    PREFILL_START = "prefill_start"
    PREFILL_END = "prefill_end"
    TRANSFER_START = "transfer_start"
    TRANSFER_END = "transfer_end"
    DECODE_FIRST_TOKEN = "decode_first_token"


# Worker stage stamps -> the human timeline's names.
STAGES = {
    "send:received": Stage.QUEUE,
    "send:prefill_start": Stage.PREFILL_START,
    "send:first_token": Stage.PREFILL_END,
    "send:ready": Stage.TRANSFER_START,
    "recv:done": Stage.TRANSFER_END,
    "local:prefill_start": Stage.PREFILL_START,
    "local:first_token": Stage.PREFILL_END,
}


def labelled(ev: Ev, detail: str) -> str:
    """`route: remote`, `worker_down: stuck`, ..."""
    return f"{ev.value}: {detail}"


def staged(side: Side | str, stage: str) -> str:
    """A worker's stage stamp: `send:first_token`, `recv:done`, ..."""
    return f"{side}:{stage}"


def kind_of(event: str) -> str:
    """The vocabulary word an event name starts with: `worker_down: stuck` -> `worker_down`,
    `send:ready` -> `send` (compare with `Ev`/`Side` members)."""
    return event.split(":", 1)[0]


def first(events: list[Event], ev: str, worker: str | None = None) -> float | None:
    """Time of the first `ev` (by `worker` if given), or None."""
    return next((t for e, w, t in events if e == ev and (worker is None or w == worker)), None)


def render(events: list[Event]) -> list[dict[str, Any]]:
    """The request's events for people: known stages under their public names (queue,
    prefill_start/end, transfer_start/end, decode_first_token), times in ms from arrival."""
    t0, out, first_by = events[0][2], [], None
    for event, worker, t in events:
        name = str(STAGES.get(event, event))
        if event == Ev.FIRST_TOKEN:
            first_by = first_by or worker
            name = Ev.FIRST_TOKEN.value if worker == first_by else Stage.DECODE_FIRST_TOKEN.value
        out.append({"event": name, "worker": worker, "t_ms": round((t - t0) * 1000, 3)})
    return out


class Timelines:
    """Finished requests' timelines and scored predictions, the last `TIMELINE_KEEP` of them."""

    def __init__(self, events: RouterEvents) -> None:
        self.events = events
        self.raw: collections.OrderedDict[str, list[Event]] = collections.OrderedDict()
        self.predictions: dict[str, dict[str, Any]] = {}  # kept beside raw
        self._final_attempt: dict[str, str] = {}

    def keep(self, flight: Flight) -> None:
        self.raw[flight.rid] = sorted(flight.timeline, key=lambda e: e[2])
        self._final_attempt[flight.rid] = str(flight.attempt)
        while len(self.raw) > TIMELINE_KEEP:
            old, _ = self.raw.popitem(last=False)
            self._final_attempt.pop(old, None)
            self.predictions.pop(old, None)

    def add_late(self, rid: str, attempt: str, stamps: list[Event]) -> bool:
        """Add stamps that arrive after the request finished (P's TransferReport trails D's
        ack); False when the request or that attempt is no longer kept."""
        events = self.raw.get(rid)
        if events is None or self._final_attempt.get(rid) != attempt:
            return False
        events += stamps
        events.sort(key=lambda e: e[2])
        return True

    def score(self, flight: Flight, outcome: str, planner: SloPlanner | None) -> None:
        """Predicted vs actual TTFT/TPOT: kept for the timeline, fed to the metric of
        prediction error and to the planner's online calibration."""
        pred = flight.prediction
        if pred is None:
            return
        arrive = flight.timeline[0][2]
        ttft = flight.first_at - arrive if flight.first_at is not None else None
        n = len(flight.sent)
        tpot = None
        if outcome == "ok" and n > 1 and flight.first_at is not None and flight.last_at:
            tpot = (flight.last_at - flight.first_at) / (n - 1)
        self.predictions[flight.rid] = {
            "route": pred.route.kind,
            "workers": [w for w in (pred.route.first, pred.route.decode) if w],
            "ttft_s": round(pred.ttft_s, 6),
            "tpot_s": round(pred.tpot_s, 6),
            "cached_prefill_tokens": pred.cached_first,
            "cached_decode_tokens": pred.cached_decode,
            "pooled_prefill_tokens": pred.pooled_first,
            "actual_ttft_s": None if ttft is None else round(ttft, 6),
            "actual_tpot_s": None if tpot is None else round(tpot, 6),
        }
        for kind, predicted, actual in (("ttft", pred.ttft_s, ttft), ("tpot", pred.tpot_s, tpot)):
            if actual is not None and actual > 0:
                self.events.prediction(kind, abs(predicted - actual) / actual)
        if planner is not None and flight.attempt == 1:
            planner.learn(flight.raw_pred, ttft, tpot, n)
