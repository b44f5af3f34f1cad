"""An in-memory transport keeping transfer/api.py's contract, for tests: no sockets, no threads.

A `FakeNetwork` is one process's links: receivers bind an endpoint in it (`fake://<worker id>`),
senders reach them by it. Everything sent is copied at once, as a wire would (a frame's buffers
may be reused as soon as `send_layer` returns), and delivered in order by the next `poll`.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.transfer.api import KVLinkError, KVSink, LinkSetup
from pdserve.transfer.wire import Part


@dataclass
class FakeNetwork:
    name: str = "fake"
    receivers: dict[str, FakeReceiver] = field(default_factory=dict)  # by endpoint
    senders: dict[bytes, FakeSender] = field(default_factory=dict)  # by identity

    def receiver(self, setup: LinkSetup) -> FakeReceiver:
        endpoint = f"fake://{setup.worker_id}"
        if endpoint in self.receivers:
            raise ValueError(f"{endpoint} is bound already")
        self.receivers[endpoint] = r = FakeReceiver(self, endpoint)
        return r

    def sender(self, setup: LinkSetup) -> FakeSender:
        self.senders[setup.worker_id.encode()] = s = FakeSender(self, setup)
        return s


# An arrival at a receiver: (sender's identity, frame parts, None) or (identity, None, message)
Arrival = tuple[bytes, list[bytes] | None, bytes | None]


class FakeReceiver:
    def __init__(self, network: FakeNetwork, endpoint: str) -> None:
        self.network, self._endpoint = network, endpoint
        self.inbox: collections.deque[Arrival] = collections.deque()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def poll(self, sink: KVSink) -> None:
        while self.inbox:
            peer, frame, message = self.inbox.popleft()
            if frame is not None:
                sink.on_frame(peer, frame)
            elif message is not None:
                sink.on_message(peer, message)

    def reply(self, peer: bytes, message: bytes) -> None:
        sender = self.network.senders.get(peer)
        if sender is None or sender.closed:
            raise KVLinkError(f"cannot reach {peer!r}: no such sender")
        sender.inbox.append(bytes(message))

    def close(self) -> None:
        self.network.receivers.pop(self._endpoint, None)


class FakeSender:
    def __init__(self, network: FakeNetwork, setup: LinkSetup) -> None:
        self.network, self.identity = network, setup.worker_id.encode()
        self.counters = setup.counters
        self.inbox: collections.deque[bytes] = collections.deque()
        self.held: set[str] = set()  # requests with frames sent and no `done` yet
        self.closed = False

    def send_layer(self, dest: str, rid: str, frame: Sequence[Part]) -> None:
        self.held.add(rid)
        self._deliver(dest, ([bytes(p) for p in frame], None))

    def send(self, dest: str, message: bytes) -> None:
        self._deliver(dest, (None, bytes(message)))

    def _deliver(self, dest: str, what: tuple[list[bytes] | None, bytes | None]) -> None:
        receiver = self.network.receivers.get(dest)
        if receiver is None:  # nobody bound there: lost, as a full queue's frame is
            self.counters["kv_sends_dropped"] += 1
            return
        receiver.inbox.append((self.identity, *what))

    def done(self, rid: str) -> None:
        self.held.discard(rid)

    def poll(self) -> list[bytes]:
        out = list(self.inbox)
        self.inbox.clear()
        return out

    def close(self) -> None:
        self.closed = True
