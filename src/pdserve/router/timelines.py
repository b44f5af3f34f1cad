"""`Timelines`: finished requests' timelines (the last `TIMELINE_KEEP`), and their predictions
scored against what happened: the metric of prediction error and the planner's online
calibration (`SloPlanner.learn`)."""

from __future__ import annotations

import collections
from typing import Any

from pdserve.router.events import RouterEvents
from pdserve.router.flight import Flight, decode_load
from pdserve.router.loads import less_held
from pdserve.router.slo import SloPlanner
from pdserve.router.timeline import TIMELINE_KEEP, Event


class Timelines:
    """Finished requests' timelines and scored predictions, the last `TIMELINE_KEEP` of them."""

    def __init__(self, events: RouterEvents) -> None:
        self.events = events
        self.raw: collections.OrderedDict[str, list[Event]] = collections.OrderedDict()
        self.predictions: dict[str, dict[str, Any]] = {}  # kept beside raw
        self.spec: dict[str, dict[str, int]] = {}  # speculation per request, beside raw
        self._final_attempt: dict[str, str] = {}

    def keep(self, flight: Flight) -> None:
        self.raw[flight.rid] = sorted(flight.timeline, key=lambda e: e[2])
        self._final_attempt[flight.rid] = str(flight.attempt)
        if flight.spec:
            self.spec[flight.rid] = dict(flight.spec)
        while len(self.raw) > TIMELINE_KEEP:
            old, _ = self.raw.popitem(last=False)
            self._final_attempt.pop(old, None)
            self.spec.pop(old, None)
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
            planner.learn(flight.raw_pred, ttft, _stepping_tpot(flight, tpot, n), n, flight.seen)


def _stepping_tpot(flight: Flight, tpot: float | None, n: int) -> float | None:
    """`tpot` less the time its decode worker was held meanwhile (`hold_decode`). The step
    model predicts steps, not the thread policy's holds, which each stay within every
    request's TPOT slack: learned with them, the calibration rose to 3x and admission refused
    requests (slo_tpot) that the hold would have let through."""
    dec = decode_load(flight)
    if tpot is None or dec is None or flight.last_at is None:
        return tpot
    return less_held(tpot, dec.held_s(flight.last_at) - flight.held_at_first, n)
