"""`WorkerContext`: what the P and D sides of the hand-off (prefill.py, decode.py) get from the
worker that holds them, and nothing else.

The worker builds one and hands it to both sides, with each side's end of the KV link
(transfer/api.py: P a `KVSender`, D a `KVReceiver`). The sides call back into the worker only
through `emit`; they share its per-request clients and its counters. Tests build one around an
engine and the fake link (transfer/fake.py), with no worker and no socket.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


@dataclass(frozen=True)
class HandoffSettings:
    """The hand-off's knobs (config.py `WorkerConfig` has their help) and the KV fingerprint
    every frame carries and is checked against (workers/pool.py `kv_fingerprint`)."""

    fingerprint: bytes
    kv_codec: str = "none"
    stream_kv: bool = True  # send each layer's KV as it is computed (else after the prefill)
    deadline_s: float = 5.0
    lease_s: float = 10.0
    kv_wait_s: float = 30.0  # at least deadline_s


@dataclass(frozen=True)
class WorkerContext:
    worker_id: str
    engine: LLMEngine
    settings: HandoffSettings
    emit: Callable[[str, object], None]  # a message to whoever asked for request `rid`
    clients: dict[str, bytes] = field(default_factory=dict)  # request id -> who asked
    counters: collections.Counter[str] = field(default_factory=collections.Counter)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("pdserve.worker"))
