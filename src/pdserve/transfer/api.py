"""The KV link between a prefill worker (P) and a decode worker (D): `KVSender`, `KVReceiver`.

D holds one `KVReceiver`, bound at its `endpoint` (which D advertises; the router hands it to P).
P holds one `KVSender`, which reaches any number of D workers by their endpoints. Between one P
and one D the link carries, in order:
  * P -> D: frames (`send_layer`: one request's KV for a layer range and a token range, a
    transfer/wire.py frame, checked by D) and the hand-off's messages (`send`);
  * D -> P: messages (`reply`, to the sender's identity that came with what it sent).
Messages are opaque bytes here: workers/messages.py encodes them (KVWant, KVReady, KVDone, KVAck,
KVFail; the hand-off's protocol is in workers/prefill.py and workers/decode.py).

What every implementation keeps (tests/transfer/test_link_contract.py runs the same sequence
over each of them):
  * order: what one sender sends one receiver arrives in the order it was sent, frames and
    messages alike (D requires each layer's token ranges in order);
  * nothing blocks: a send that cannot go now is dropped and counted (`kv_sends_dropped`): D's
    completeness check then fails the hand-off, which the router retries; `poll` never waits;
  * who frees what: the sender may hold resources per request (the shm ring's space) until
    `done(rid)`, which P calls once that request's hand-off is over (acknowledged, failed,
    aborted); P's KV blocks are the engine's, held until KVAck, KVFail or the lease's end;
  * a received frame's buffers are valid only during `KVSink.on_frame` (D copies them into its
    KV blocks there).

Implementations: transfer/transports.py (`tcp`, `ipc`, `shm`, `inproc` over ZeroMQ; the registry
`TRANSPORTS` that `--transport` names) and transfer/fake.py (in memory, for tests).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.transfer.wire import Part

if TYPE_CHECKING:
    import zmq


class KVLinkError(OSError):
    """The other end cannot be reached (a D replying to a P that is gone)."""


class KVSink(Protocol):
    """What a receiver hands arrivals to: D's side of the hand-off."""

    def on_frame(self, peer: bytes, frame: Sequence[Part]) -> None:
        """A wire frame's parts (header, payload...) from `peer`, valid during this call only."""

    def on_message(self, peer: bytes, message: Part) -> None:
        """A hand-off message from `peer`."""


class KVSender(Protocol):
    """P's end: links to D workers by endpoint, opened on first use."""

    def send_layer(self, dest: str, rid: str, frame: Sequence[Part]) -> None:
        """Send request `rid`'s frame (transfer/wire.py `encode_frame` parts) to D at `dest`."""

    def send(self, dest: str, message: bytes) -> None:
        """Send a hand-off message to D at `dest`, after everything sent there before it."""

    def done(self, rid: str) -> None:
        """`rid`'s hand-off is over: free what the link holds for it."""

    def poll(self) -> list[bytes]:
        """The messages D workers sent back since the last call, without waiting."""

    def close(self) -> None: ...


class KVReceiver(Protocol):
    """D's end: bound at `endpoint`, where senders connect."""

    @property
    def endpoint(self) -> str: ...

    def poll(self, sink: KVSink) -> None:
        """Hand what arrived to `sink`, in order, without waiting: all of it, or what a
        short time budget allows (the rest keeps the worker's poller readable)."""

    def reply(self, peer: bytes, message: bytes) -> None:
        """Send a message back to the sender `peer`; raises KVLinkError if it is gone."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class LinkSetup:
    """What a transport builds a worker's sender and receiver from."""

    worker_id: str  # the sender's identity, as `peer` at the receiver
    host: str = "127.0.0.1"  # the receiver binds here (tcp)
    port: int = 0  # and here; 0 picks a free port
    shm_bytes: int = 0  # the shm transport's ring, per sender (0: every frame inline)
    # The worker's counters: links count what they drop or fall back on (`kv_sends_dropped`,
    # `bad_frames`, `shm_inline_frames`), reported in its stats.
    counters: collections.Counter[str] = field(default_factory=collections.Counter)
    # The worker's loop waits on this poller: a link registers its sockets (or a file
    # descriptor that turns readable when something arrives) so the loop wakes for it.
    poller: zmq.Poller | None = None
    zmq_context: zmq.Context[Any] | None = None  # inproc: every worker of the process shares one


class Transport(Protocol):
    """One way of moving KV, by name in transfer/transports.py `TRANSPORTS`."""

    @property
    def name(self) -> str: ...

    def receiver(self, setup: LinkSetup) -> KVReceiver: ...

    def sender(self, setup: LinkSetup) -> KVSender: ...
