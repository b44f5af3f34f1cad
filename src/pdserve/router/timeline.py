"""Request timelines: the event vocabulary and rendering them for people (timelines.py keeps
finished requests' timelines and scores the planner's predictions against what happened).

A timeline is a list of `(event, worker, time.monotonic())`. Event names are the `Ev` members
(plain strings, so a timeline is still JSON and tuples compare as before), some with a detail
(`route: remote`, `worker_down: stuck`, built by `labelled`), plus the workers' own stage stamps
`side:stage` (`send:first_token`, `recv:done`, built by `staged`). Readers (cluster, chaos,
metrics, bench) test events with `Ev`/`Side` and `kind_of`, never by spelling the strings.

This module imports nothing from pdserve, so metrics and bench may import it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

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
    # admitted although predicted to miss an SLO, for the planner to learn (slo.decide)
    ADMITTED_TO_CALIBRATE = "admitted_to_calibrate"
    FAILED = "failed"  # labelled with the worker's reason
    WORKER_DOWN = "worker_down"  # labelled with no_heartbeat | stuck
    # the KV pool (issue 15), from the prefilling worker's report: labelled with token counts
    POOL_LOOKUP = "pool_lookup"  # tokens the pool held after the worker's own prefix cache
    POOL_LOAD = "pool_load"  # tokens loaded of those (the rest were recomputed)
    RECOVERED_FROM_POOL = "recovered_from_pool"  # a recovery: tokens loaded vs recomputed
    # prompt tokens a worker found cached (the prefilling worker's prefix cache and pool; D's
    # KV held already in a hand-off): labelled "N tokens"
    CACHED = "cached"
    # a conversation's follow-up: "hit N tokens" when the worker holding its history had all of
    # it, "miss N of M tokens" when it was evicted (prefilled again)
    CONVERSATION = "conversation"
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
