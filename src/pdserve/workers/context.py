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

from pdserve.config import WorkerConfig

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


@dataclass(frozen=True)
class HandoffSettings:
    """The hand-off's knobs (config.py `WorkerConfig` has their help and defaults) and the KV
    fingerprint every frame carries and is checked against (workers/pool.py `kv_fingerprint`)."""

    fingerprint: bytes
    kv_codec: str = WorkerConfig.kv_codec
    stream_kv: bool = WorkerConfig.stream_kv  # each layer's KV as it is computed, else after
    deadline_s: float = WorkerConfig.deadline_s
    lease_s: float = WorkerConfig.lease_s
    kv_wait_s: float = WorkerConfig.kv_wait_s

    @classmethod
    def of(cls, config: WorkerConfig, fingerprint: bytes) -> HandoffSettings:
        # D's wait for a first frame is never shorter than the silence any other stage allows
        kv_wait_s = max(config.deadline_s, config.kv_wait_s)
        return cls(
            fingerprint, config.kv_codec, config.stream_kv, config.deadline_s, config.lease_s,
            kv_wait_s,
        )  # fmt: skip


@dataclass(frozen=True)
class WorkerContext:
    worker_id: str
    engine: LLMEngine
    settings: HandoffSettings
    emit: Callable[[str, object], None]  # a message to whoever asked for request `rid`
    clients: dict[str, bytes] = field(default_factory=dict)  # request id -> who asked
    counters: collections.Counter[str] = field(default_factory=collections.Counter)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("pdserve.worker"))

    def decode_link_message(self, data: bytes | memoryview) -> object | None:
        """A message from the KV link, or None for one that does not decode (counted in
        `bad_messages` and logged: a peer's bad bytes never stop the worker's loop)."""
        from pdserve.workers import messages as m

        try:
            return m.decode(data)
        except m.MessageError as e:
            self.counters["bad_messages"] += 1
            self.log.warning("dropping a bad message on the KV link: %s", e)
            return None
