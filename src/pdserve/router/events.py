"""RouterEvents: the one sink for what the router counts. Each happening bumps its counter
(`core.counters`, what tests, the cluster and /admin read) and tells the metrics, if any
(`pdserve.metrics.Metrics`; a null object by default, so no caller checks for None)."""

from __future__ import annotations

import collections
from typing import Any, Protocol


class MetricsHooks(Protocol):
    """The hooks of `pdserve.metrics.Metrics` the router calls."""

    def on_rejected(self, code: str | None = None) -> None: ...
    def on_refused(self, code: str) -> None: ...
    def on_route(self, route: str) -> None: ...
    def on_prediction(self, kind: str, rel_error: float) -> None: ...
    def on_role_switch(self, by: str) -> None: ...
    def on_recompute(self) -> None: ...
    def on_thread_move(self, to: str) -> None: ...
    def on_request_end(self, flight: Any, outcome: str) -> None: ...
    def on_worker_stats(self, worker: Any, stats: dict[str, Any]) -> None: ...
    def on_transfer(self, report: Any) -> None: ...
    def on_retry(self, failed: Any) -> None: ...
    def on_worker_down(self, worker: Any, reason: str) -> None: ...
    def on_recovery(self, how: str) -> None: ...
    def on_conversation(self, outcome: str) -> None: ...


class NoMetrics:
    """The null object: every hook does nothing."""

    def on_rejected(self, code: str | None = None) -> None:
        pass

    def on_refused(self, code: str) -> None:
        pass

    def on_route(self, route: str) -> None:
        pass

    def on_prediction(self, kind: str, rel_error: float) -> None:
        pass

    def on_role_switch(self, by: str) -> None:
        pass

    def on_recompute(self) -> None:
        pass

    def on_thread_move(self, to: str) -> None:
        pass

    def on_request_end(self, flight: Any, outcome: str) -> None:
        pass

    def on_worker_stats(self, worker: Any, stats: dict[str, Any]) -> None:
        pass

    def on_transfer(self, report: Any) -> None:
        pass

    def on_retry(self, failed: Any) -> None:
        pass

    def on_worker_down(self, worker: Any, reason: str) -> None:
        pass

    def on_recovery(self, how: str) -> None:
        pass

    def on_conversation(self, outcome: str) -> None:
        pass


class RouterEvents:
    def __init__(self, metrics: MetricsHooks | None = None) -> None:
        self.counters: collections.Counter[str] = collections.Counter()
        self.metrics = metrics

    @property
    def metrics(self) -> MetricsHooks | None:
        """The attached metrics, or None (the HTTP app attaches its own when there is none)."""
        return None if isinstance(self._hooks, NoMetrics) else self._hooks

    @metrics.setter
    def metrics(self, metrics: MetricsHooks | None) -> None:
        self._hooks: MetricsHooks = NoMetrics() if metrics is None else metrics

    def count(self, name: str, n: int = 1) -> None:
        """A happening with no metric of its own (retries of a message, resyncs, ...)."""
        self.counters[name] += n

    def overloaded(self) -> None:
        self.counters["requests_rejected"] += 1
        self._hooks.on_rejected("overloaded")

    def refused(self, reason: str) -> None:
        self.counters[f"rejected_{reason}"] += 1
        self._hooks.on_refused(reason)

    def route(self, kind: str) -> None:
        self.counters[f"route_{kind}"] += 1
        self._hooks.on_route(kind)

    def request_end(self, flight: Any, outcome: str) -> None:
        self.counters[f"requests_{outcome}"] += 1
        self._hooks.on_request_end(flight, outcome)

    def conversation(self, outcome: str) -> None:
        """A conversation's follow-up ended: hit (its history was cached where it went), miss
        (evicted: prefilled again) or moved (the planner sent it elsewhere)."""
        self.counters[f"conversation_{outcome}"] += 1
        self._hooks.on_conversation(outcome)

    def worker_stats(self, worker: Any, stats: dict[str, Any]) -> None:
        self._hooks.on_worker_stats(worker, stats)

    def transfer(self, report: Any) -> None:
        self.counters[f"kv_{report.side}_bytes"] += report.nbytes
        self.counters[f"kv_{report.side}_frames"] += report.frames
        self._hooks.on_transfer(report)

    def retry(self, failed: Any) -> None:
        self.counters["retries"] += 1
        self._hooks.on_retry(failed)

    def recompute(self) -> None:
        self.counters["recomputes"] += 1
        self._hooks.on_recompute()

    def worker_down(self, worker: Any, reason: str) -> None:
        self.counters["workers_down"] += 1
        self._hooks.on_worker_down(worker, reason)

    def recovered(self, how: str) -> None:
        """A recovered request was dispatched again (`recoveries` counts the attempts)."""
        self._hooks.on_recovery(how)

    def role_switch(self, by: str) -> None:
        self.counters[f"role_switches_{by}"] += 1
        self._hooks.on_role_switch(by)

    def thread_move(self, to: str) -> None:
        """The P/D thread split changed in favour of pool `to` (router/thread_moves.py)."""
        self.counters[f"thread_moves_to_{to}"] += 1
        self._hooks.on_thread_move(to)

    def prediction(self, kind: str, rel_error: float) -> None:
        self._hooks.on_prediction(kind, rel_error)
