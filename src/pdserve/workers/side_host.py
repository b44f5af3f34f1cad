"""`SideHost`: what the P and D sides (prefill.py, decode.py) use of the worker that holds them.

The sides keep a back-pointer to their `Worker`; typing it as this protocol keeps the imports
one-way (worker.py imports the sides, never the reverse, not even for types) and lists in one
place how far the sides reach into the worker: its engine, sockets, settings, per-request
clients and counters, and the two calls back (`emit` a message to a request's client; route a
decode worker's reply, `on_kv_reply`).
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import zmq

    from pdserve.engine.engine import LLMEngine


class SideHost(Protocol):
    @property
    def worker_id(self) -> str: ...
    @property
    def engine(self) -> LLMEngine: ...
    @property
    def log(self) -> logging.Logger: ...
    @property
    def counters(self) -> collections.Counter[str]: ...
    @property
    def clients(self) -> dict[str, bytes]: ...  # request id -> identity of who asked

    # sockets: the context, the worker's poller, D's KV receiver
    @property
    def ctx(self) -> zmq.Context[Any]: ...
    @property
    def poller(self) -> zmq.Poller: ...
    @property
    def kv_in(self) -> zmq.Socket[Any]: ...

    # settings (config.py WorkerConfig) and the KV layout's fingerprint
    @property
    def fingerprint(self) -> bytes: ...
    @property
    def kv_codec(self) -> str: ...
    @property
    def transport(self) -> str: ...
    @property
    def shm_bytes(self) -> int: ...
    @property
    def stream_kv(self) -> bool: ...
    @property
    def deadline_s(self) -> float: ...
    @property
    def lease_s(self) -> float: ...
    @property
    def kv_wait_s(self) -> float: ...

    def emit(self, rid: str, msg: object) -> None: ...
    def on_kv_reply(self, parts: list[Any], mid_step: bool = False) -> None: ...
