"""What the router knows about one worker (`WorkerState`) and one request (`Flight`), and what
a request yields (`Delta`) or raises (`RequestError`): plain data shared by the router's modules."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import zmq.asyncio

from pdserve.engine.request import SamplingParams
from pdserve.router import slo
from pdserve.router.loads import WorkerLoad
from pdserve.router.timeline import Event
from pdserve.router.worker_stats import WorkerStats
from pdserve.workers import messages as m


class RequestError(Exception):
    """A request that cannot be served; `status` is the HTTP status the router answers with."""

    def __init__(
        self,
        message: str,
        status: int = 503,
        code: str = "unavailable",
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.code = message, status, code
        self.retry_after_s = retry_after_s  # sent as Retry-After on 429/503


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # set on the last delta of its choice
    stop_reason: int | str | None = None
    index: int = 0  # the choice (n > 1)


@dataclass
class WorkerState:
    endpoint: str
    sock: zmq.asyncio.Socket
    info: m.WorkerInfo | None = None
    healthy: bool = False
    stats: WorkerStats = field(default_factory=WorkerStats)  # its last report
    outstanding: int = 0
    last_seen: float = 0.0
    hb: zmq.asyncio.Socket | None = None  # heartbeat socket (Ping -> Pong)
    last_pong: float = 0.0
    loop_age: float = 0.0  # the worker's own report: since its main loop last turned
    work_age: float = -1.0  # since its loop turned or a model layer finished (-1: unreported)
    down_reason: str | None = None  # why it was taken out of routing
    draining: bool = False  # out of routing until its requests finish (a role switch)
    load: WorkerLoad = field(default_factory=lambda: WorkerLoad(""))

    @property
    def idle_age(self) -> float:
        """Since the worker last made progress, as its last pong said: a loop that has not
        turned while model layers finish is one long step, busy rather than stuck."""
        return self.loop_age if self.work_age < 0 else self.work_age

    @property
    def worker_id(self) -> str:
        return self.info.worker_id if self.info else self.endpoint

    @property
    def role(self) -> str:
        return self.info.role if self.info else "unknown"


@dataclass
class Flight:
    """One request in flight; `attempt` changes the id the workers see on every retry."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    attempt: int = 1
    pair: tuple[WorkerState, WorkerState | None] | None = None
    sent: list[int] = field(default_factory=list)  # tokens already streamed to the client
    timeline: list[Event] = field(default_factory=list)
    last_event: float = field(default_factory=time.monotonic)
    finished: bool = False
    p_done: bool = False  # P's hand-off tokens delivered (D's may be delivered after them)
    held: list[m.Tokens] = field(default_factory=list)  # D's tokens that overtook P's
    recoveries: int = 0  # re-dispatches after a worker of this request went down
    session: str | None = None  # the client's conversation (OpenAI `user`): affinity
    route: str = ""  # remote | local | colocated | fallback
    prediction: slo.Prediction | None = None  # the planner's, for the first dispatch
    raw_pred: tuple[float, ...] = (0.0, 0.0)  # the same before online calibration
    seen: tuple[float, float] | None = None  # the mean decode batch it met (`Job.seen`)
    first_at: float | None = None  # router time of the first and last tokens delivered
    last_at: float | None = None
    held_at_first: float = 0.0  # its decode worker's `held_s` clock at the first token
    choices_done: set[int] = field(default_factory=set)  # n > 1: the choices that ended
    sent_other: bool = False  # n > 1: tokens of choices other than 0 were streamed
    spec: dict[str, int] = field(default_factory=dict)  # speculation, summed over choices
    pool_recovered: int = 0  # the attempt whose `recovered_from_pool` is in the timeline
    # (prefilling worker, tokens the pool index predicts it loads, the attempt's prompt length)
    pool_expected: tuple[str, int, int] | None = None
    cached: dict[str, int] = field(default_factory=dict)  # worker -> prompt tokens it had cached
    # a follow-up: (the worker holding the conversation's history, its KV tokens there)
    history: tuple[str, int] | None = None

    @property
    def wire_rid(self) -> str:
        return f"{self.rid}.{self.attempt}"


def decode_load(flight: Flight) -> WorkerLoad | None:
    """The router's load of the worker that decodes `flight` (D, or the one worker of a local
    or colocated route)."""
    if flight.pair is None:
        return None
    return (flight.pair[1] or flight.pair[0]).load
