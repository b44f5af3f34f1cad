"""A scripted stand-in for RouterCore: the interface the HTTP app uses, no workers.

A script is a list of steps, played by the next `generate` call: a `Delta` is yielded, an
exception is raised, a number is slept (seconds). Without a script a request streams
`max_tokens` one-token deltas and finishes with "length". Every request records how it ended
(`outcomes[rid]`: ok | error | aborted) and sets `ended[rid]` (a threading.Event, so a test
can wait on a server running in another thread), like the real core which aborts on close.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from pdserve.engine.request import SamplingParams
from pdserve.router.core import Delta, RequestError
from pdserve.workers import messages as m

Step: TypeAlias = Delta | BaseException | float


@dataclass
class FakeFlight:
    rid: str
    prompt_ids: list[int]
    sent: list[int] = field(default_factory=list)
    timeline: list[tuple[str, str, float]] = field(default_factory=list)


@dataclass
class FakeWorker:
    worker_id: str
    role: str


def default_rows() -> list[dict[str, Any]]:
    return [
        {
            "id": wid,
            "role": role,
            "url": f"tcp://127.0.0.1:{5550 + i}",
            "pid": 1000 + i,
            "healthy": True,
            "queue": 0,
            "running": 0,
            "outstanding": 0,
            "kv_blocks_used": 0,
            "kv_blocks_total": 64,
        }
        for i, (wid, role) in enumerate((("P0", "prefill"), ("D0", "decode")))
    ]


def default_script(params: SamplingParams) -> list[Step]:
    """max_tokens deltas per choice, the choices interleaved as a worker streams them; choice
    c's i-th token is 300 + 100 c + i, its text " w{i}" (choice 0) or " c{c}w{i}"."""
    steps: list[Step] = []
    for i in range(params.max_tokens):
        for c in range(params.n):
            tid = 300 + 100 * c + i
            logprobs = None
            if params.logprobs is not None:
                top = {tid: -0.25}
                for j in range(params.logprobs):
                    top.setdefault(1000 + j, -1.0 - j)
                logprobs = [top]
            last = i == params.max_tokens - 1
            text = f" w{i}" if c == 0 else f" c{c}w{i}"
            steps.append(Delta([tid], text, logprobs, "length" if last else None, index=c))
    return steps


class FakeCore:
    def __init__(self, model: str = "/models/fake-model") -> None:
        self.model = model
        self.metrics: Any = None
        self.rows = default_rows()
        self.role_switches: list[tuple[str, str, str]] = []
        self.scripts: collections.deque[list[Step]] = collections.deque()
        self.calls: list[tuple[str, list[int], SamplingParams]] = []
        self.outcomes: dict[str, str] = {}
        self.ended: collections.defaultdict[str, threading.Event] = collections.defaultdict(
            threading.Event
        )
        self.started = threading.Event()  # set when a request yields its first delta
        self.timelines: dict[str, list[dict[str, Any]]] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self.heartbeat_ages: dict[str, float] = {}
        self.worker_stats: dict[str, dict[str, Any]] = {}

    def script(self, *steps: Step) -> None:
        """Queue the steps the next request plays."""
        self.scripts.append(list(steps))

    def last_rid(self) -> str:
        return self.calls[-1][0]

    async def generate(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        session: str | None = None,
    ) -> AsyncIterator[Delta]:
        self.calls.append((rid, list(prompt_ids), params))
        steps = self.scripts.popleft() if self.scripts else default_script(params)
        flight = FakeFlight(rid, list(prompt_ids))
        flight.timeline.append(("arrive", "router", time.monotonic()))
        outcome = "error"
        try:
            flight.timeline.append(("dispatch", "attempt 1", time.monotonic()))
            for step in steps:
                if isinstance(step, BaseException):
                    raise step
                if isinstance(step, int | float):
                    await asyncio.sleep(step)
                    continue
                if step.token_ids and not flight.sent:
                    flight.timeline.append(("first_token", "D0", time.monotonic()))
                flight.sent += step.token_ids
                self.started.set()
                yield step
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "aborted"
            raise
        finally:
            flight.timeline.append(
                ("finish" if outcome == "ok" else outcome, "router", time.monotonic())
            )
            t0 = flight.timeline[0][2]
            self.timelines[rid] = [
                {"event": e, "worker": w, "t_ms": round((t - t0) * 1000, 3)}
                for e, w, t in flight.timeline
            ]
            self.counters[f"requests_{outcome}"] += 1
            self.outcomes[rid] = outcome
            if self.metrics is not None:
                self.metrics.on_request_end(flight, outcome)
            self.ended[rid].set()

    async def set_role(self, worker_id: str, role: str, by: str = "admin") -> dict[str, Any]:
        row = next((r for r in self.rows if r["id"] == worker_id), None)
        if row is None:
            raise RequestError(f"no worker {worker_id!r}", 404, "not_found")
        row["role"] = role
        self.role_switches.append((worker_id, role, by))
        return dict(row)

    def worker_table(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.rows]

    def timeline(self, rid: str) -> list[dict[str, Any]] | None:
        return self.timelines.get(rid)

    def worker_vitals(self) -> dict[str, dict[str, Any]]:
        """Like RouterCore's: heartbeat ages and last stats (settable: `heartbeat_ages`,
        `worker_stats`)."""
        return {
            r["id"]: {
                "heartbeat_age_s": self.heartbeat_ages.get(r["id"], 0.1),
                "stats": dict(self.worker_stats.get(r["id"], {})),
            }
            for r in self.rows
        }

    # ---- what the real core reports from its workers -------------------------------------------
    def emit_worker_stats(self) -> None:
        for row in self.rows:
            stats = {
                "waiting": 2,
                "running": 3,
                "kv_blocks_used": 10,
                "kv_blocks_total": row["kv_blocks_total"],
                "prefix_cache_hit_rate": 0.5,
                "preemptions": 1,
                "transfer_failures": 0,
                "lease_reclaims": 0,
                "handoffs_acked": 4 if row["role"] == "prefill" else 0,
                "handoffs_received": 4 if row["role"] == "decode" else 0,
                "gc_collections": 12,
                "gc_full_collections": 1,
                "gc_pause_seconds": 0.25,
                "gc_max_pause_seconds": 0.2,
                "gc_frozen_objects": 800_000,
                **(
                    {
                        "spec_draft_tokens": 40,
                        "spec_accepted_tokens": 25,
                        "spec_steps": 10,
                        "spec_accepted_at": [9, 7, 5, 4],
                    }
                    if row["role"] == "decode"
                    else {}
                ),
                "worker_id": row["id"],
                "role": row["role"],
            }
            self.metrics.on_worker_stats(FakeWorker(row["id"], row["role"]), stats)

    def emit_transfer(self, nbytes: int = 4096, seconds: float = 0.002) -> None:
        for side, worker in (("send", "P0"), ("recv", "D0")):
            report = m.TransferReport("x.1", worker, side, 2, nbytes, seconds, "none")
            self.metrics.on_transfer(report)
        self.metrics.on_retry(m.RequestFailed("x.1", "D0", "lost", "transfer"))
