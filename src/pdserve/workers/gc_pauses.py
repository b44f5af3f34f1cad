"""Python's garbage collector in a worker process: freeze the start-up heap, count every pause.

Why: a worker that has loaded a model and its tokenizer holds ~800k objects the cyclic
collector tracks (the default model, w8a8, Intel Xeon: one full collection took 260-280 ms;
docs/benchmarks/engine.md). A full (generation 2) collection runs inside whatever the main
loop was doing, so it lands as a 15x-long decode step on every running request. Objects that
live as long as the process need no collecting: `GcPauses.freeze_startup_heap` moves them to
the permanent generation once start-up is done (as vLLM and SGLang do), and a full collection
afterwards only walks what was allocated since. `GcPauses` times every collection through
`gc.callbacks`, so the pauses that remain are visible (worker stats, /metrics) rather than
unexplained TPOT outliers; one over `warn_s` is also logged.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

GENERATIONS = (0, 1, 2)


class GcPauses:
    """Collections and their wall time per generation, from `gc.callbacks`."""

    def __init__(self, warn_s: float = 0.05) -> None:
        self.warn_s = warn_s
        self.collections = dict.fromkeys(GENERATIONS, 0)
        self.pause_s = dict.fromkeys(GENERATIONS, 0.0)
        self.max_pause_s = 0.0
        self._started: float | None = None
        self._counting = True
        self._installed = False
        # gc.get_freeze_count() walks the frozen list (1.4 ms for 300k objects), and the
        # router asks for stats every few hundred ms: counted once, when this class freezes
        self.frozen = gc.get_freeze_count()

    def freeze_startup_heap(self) -> int:
        """Collect what start-up left as garbage, then freeze the rest; returns how many
        objects were frozen. Call once per process, after the engine is built and before
        serving. That one collection is start-up work, not a pause of the serving loop: it is
        logged, not counted."""
        self._counting = False
        try:
            t0 = time.perf_counter()
            gc.collect()
            gc.freeze()
        finally:
            self._counting = True
        frozen = self.frozen = gc.get_freeze_count()
        log.info(
            "froze %d start-up objects out of the garbage collector's reach (the collection "
            "before it took %.0f ms)",
            frozen,
            (time.perf_counter() - t0) * 1e3,
        )
        return frozen

    def install(self) -> GcPauses:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True
        return self

    def close(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if not self._counting:
            return
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed mid-collection
            return
        spent = time.perf_counter() - self._started
        self._started = None
        gen = int(info.get("generation", 2))
        self.collections[gen] = self.collections.get(gen, 0) + 1
        self.pause_s[gen] = self.pause_s.get(gen, 0.0) + spent
        self.max_pause_s = max(self.max_pause_s, spent)
        if spent > self.warn_s:
            log.warning(
                "garbage collection of generation %d paused this process %.0f ms (%d objects "
                "frozen)",
                gen,
                spent * 1e3,
                self.frozen,
            )

    def stats(self) -> dict[str, Any]:
        """Flat numbers for a worker's stats (and the router's /metrics)."""
        return {
            "gc_collections": sum(self.collections.values()),
            "gc_full_collections": self.collections.get(2, 0),
            "gc_pause_seconds": sum(self.pause_s.values()),
            "gc_max_pause_seconds": self.max_pause_s,
            "gc_frozen_objects": self.frozen,
        }
