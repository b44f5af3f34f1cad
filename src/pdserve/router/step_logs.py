"""GET /admin/steps: the workers' own engine steps over a span of time, asked for and awaited.

Each worker keeps its last engine steps (engine/step_log.py: start on `time.monotonic()`,
seconds, decode rows, prompt chunks) and sends those begun after a time when asked (`GetSteps`,
answered with `Steps` on the same socket as every other event). A benchmark reads them after a
load phase to learn how fast the host ran during that phase (sim/level.py `run_level`), rather
than from a probe before it: a shared VM's speed moves within minutes.

The answer arrives on the core's event reader, which hands it to `answer`; `collect` waits for
every up worker's answer at most `timeout_s` and names the workers that gave none (down, busy
past the timeout) instead of waiting on them.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.workers import messages as m

TIMEOUT_S = 5.0


class StepLogs:
    def __init__(self, send: Callable[[Any, object], None]) -> None:
        self._send = send
        # per worker id, the futures waiting for its answers, oldest first (a worker answers
        # its requests in order)
        self._waiting: defaultdict[str, deque[asyncio.Future]] = defaultdict(deque)

    def answer(self, msg: m.Steps) -> None:
        """A worker's `Steps`: the answer to its oldest question (a worker answers in order);
        an answer to a question given up on (timed out) or never asked is dropped."""
        waiting = self._waiting.get(msg.worker_id)
        if waiting:
            fut = waiting.popleft()
            if not fut.done():
                fut.set_result((msg.steps, msg.threads))

    async def collect(self, workers: Sequence[Any], since: float,
                      timeout_s: float = TIMEOUT_S) -> dict[str, Any]:  # fmt: skip
        """{"since", "workers": {id: [step, ...]}, "threads": {id: [n, ...]}, "missing": [ids]}
        for the healthy workers (each step as `StepRecord.to_wire()`, the threads it ran on
        beside it; an empty list: not recorded)."""
        loop = asyncio.get_running_loop()
        asked: dict[str, asyncio.Future] = {}
        for w in workers:
            if not w.healthy or w.info is None:
                continue
            fut = loop.create_future()
            self._waiting[w.worker_id].append(fut)
            asked[w.worker_id] = fut
            self._send(w, m.GetSteps(since))
        if asked:
            await asyncio.wait(asked.values(), timeout=timeout_s)
        out: dict[str, Any] = {"since": since, "workers": {}, "threads": {}, "missing": []}
        for wid, fut in asked.items():
            if fut.done():
                out["workers"][wid], out["threads"][wid] = fut.result()
            else:
                fut.cancel()  # `answer` skips it; a late answer resolves nothing
                out["missing"].append(wid)
        return out
