"""Fake workers with scripted timings, speaking the real control protocol over inproc ZeroMQ.

Each `FakeWorker` is an asyncio task on the test's event loop. It answers Hello (WorkerInfo, then
a KVEvents snapshot), GetStats, Generate, Prefill, ExpectKV, Abort and SetRole, and "computes"
by sleeping what a `CostModel` says: one prompt at a time (prefill), else one decode step for
its whole batch. A prefill hands its request to the fake decode worker named in `Prefill`
directly (there is no KV to move). Block hashes of the prompts it has computed are published as
KVEvents, so the router's prefix index sees them exactly as with real workers.

Timings are the cost model's, so a test can predict them; they are real sleeps, so a test
leaves margins for scheduling jitter.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from pdserve.costmodel.model import CostModel
from pdserve.engine.block_pool import ROOT_HASH, hash_full_blocks
from pdserve.workers import messages as m

REGISTRY: dict[str, FakeWorker] = {}  # worker id -> fake, for P -> D hand-offs
BLOCK = 16


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    client: bytes
    handoff_to: str | None = None  # P: the decode worker to hand over to
    generated: int = 0


@dataclass
class FakeWorker:
    worker_id: str
    role: str
    ctx: zmq.asyncio.Context
    model: CostModel
    queue: list[_Req] = field(default_factory=list)  # prompts to compute, in order
    batch: dict[str, _Req] = field(default_factory=dict)  # decoding
    expected: dict[str, _Req] = field(default_factory=dict)  # D: waiting for P's hand-off
    cached: set[bytes] = field(default_factory=set)
    pending_events: list[bytes] = field(default_factory=list)
    subscribers: set[bytes] = field(default_factory=set)
    seq: int = 0
    handled: list[str] = field(default_factory=list)  # message type names, in order
    prefills: list[tuple[str, int]] = field(default_factory=list)  # (rid, new tokens computed)
    kv_pools: list[str] = field(default_factory=list)  # named in WorkerInfo (no pool behind them)

    def __post_init__(self) -> None:
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"inproc://fake-{self.worker_id}-{id(self)}"
        self.sock.bind(self.endpoint)
        self._wake = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._serve()),
            asyncio.create_task(self._compute()),
        ]
        REGISTRY[self.worker_id] = self

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.sock.close(0)
        REGISTRY.pop(self.worker_id, None)

    # ---- control ---------------------------------------------------------------------------
    async def _serve(self) -> None:
        while True:
            client, raw = await self.sock.recv_multipart()
            msg = m.decode(raw)
            self.handled.append(type(msg).__name__)
            self._handle(client, msg)
            self._wake.set()

    def _send(self, client: bytes, msg: object) -> None:
        self.sock.send_multipart([client, m.encode(msg)])

    def info(self) -> m.WorkerInfo:
        pools = list(self.kv_pools)
        return m.WorkerInfo(self.worker_id, self.role, 0, "", BLOCK, 1000, b"", "fake", "", pools)

    def _handle(self, client: bytes, msg: Any) -> None:
        if isinstance(msg, m.Hello):
            self.subscribers.add(client)
            self._send(client, self.info())
            self.seq = 0
            snap = m.KVEvents(self.worker_id, 0, BLOCK, sorted(self.cached), [], cleared=True)
            self._send(client, snap)
            self.seq = 1
        elif isinstance(msg, m.GetStats):
            stats = {"waiting": len(self.queue), "running": len(self.batch)}
            self._send(client, m.Stats({**stats, "transfers_out": 0, "transfers_in": 0}))
        elif isinstance(msg, m.Generate):
            self.queue.append(_Req(msg.rid, msg.prompt_ids, msg.params["max_tokens"], client))
        elif isinstance(msg, m.Prefill):
            req = _Req(msg.rid, msg.prompt_ids, msg.params["max_tokens"], client, msg.dest_worker)
            self.queue.append(req)
        elif isinstance(msg, m.ExpectKV):
            self.expected[msg.rid] = _Req(msg.rid, msg.prompt_ids, msg.params["max_tokens"], client)
        elif isinstance(msg, m.Abort):
            self.queue = [r for r in self.queue if r.rid != msg.rid]
            self.batch.pop(msg.rid, None)
            self.expected.pop(msg.rid, None)
        elif isinstance(msg, m.SetRole):
            self.role = msg.role
            self._send(client, self.info())

    # ---- "compute" -------------------------------------------------------------------------
    async def _compute(self) -> None:
        while True:
            if self.queue:
                await self._prefill(self.queue.pop(0))
            elif self.batch:
                await self._decode_step()
            else:
                self._wake.clear()
                await self._wake.wait()
            self._publish()

    async def _prefill(self, req: _Req) -> None:
        hashes = hash_full_blocks(req.prompt, BLOCK, ROOT_HASH)
        hit = 0
        while (
            hit < len(hashes) and hashes[hit] in self.cached and (hit + 1) * BLOCK < len(req.prompt)
        ):
            hit += 1
        new = len(req.prompt) - hit * BLOCK
        self.prefills.append((req.rid, new))
        await asyncio.sleep(self.model.prefill_s(new, hit * BLOCK))
        self._store(hashes)
        token = 1000 + len(req.prompt) % 7
        req.generated = 1
        done = req.max_tokens <= 1
        handoff = req.handoff_to is not None and not done
        self._send(
            req.client,
            m.Tokens(
                f"{req.rid}",
                self.worker_id,
                [token],
                "x",
                finished=done,
                finish_reason="length" if done else None,
                handoff=handoff,
            ),
        )
        if handoff:
            assert req.handoff_to is not None
            REGISTRY[req.handoff_to].receive(req.rid)
        elif not done:
            self.batch[req.rid] = req

    def receive(self, rid: str) -> None:
        """P's hand-off landed: the request joins this worker's batch."""
        req = self.expected.pop(rid, None)
        if req is not None:
            req.generated = 1
            self.batch[rid] = req
            self._store(hash_full_blocks(req.prompt, BLOCK, ROOT_HASH))
            self._wake.set()

    async def _decode_step(self) -> None:
        context = sum(len(r.prompt) + r.generated for r in self.batch.values())
        await asyncio.sleep(self.model.decode_step_s(len(self.batch), context))
        for req in list(self.batch.values()):
            req.generated += 1
            done = req.generated >= req.max_tokens
            self._send(
                req.client,
                m.Tokens(
                    req.rid,
                    self.worker_id,
                    [2000 + req.generated],
                    "y",
                    finished=done,
                    finish_reason="length" if done else None,
                ),
            )
            if done:
                del self.batch[req.rid]

    def _store(self, hashes: list[bytes]) -> None:
        for h in hashes:
            if h not in self.cached:
                self.cached.add(h)
                self.pending_events.append(h)

    def _publish(self) -> None:
        if not self.pending_events:
            return
        msg = m.KVEvents(self.worker_id, self.seq, BLOCK, self.pending_events, [])
        self.pending_events, self.seq = [], self.seq + 1
        for client in self.subscribers:
            self._send(client, msg)


async def start_fakes(
    ctx: zmq.asyncio.Context, model: CostModel, roles: dict[str, str]
) -> list[FakeWorker]:
    """{"P0": "prefill", "D0": "decode", ...} -> started fakes."""
    return [FakeWorker(wid, role, ctx, model) for wid, role in roles.items()]
