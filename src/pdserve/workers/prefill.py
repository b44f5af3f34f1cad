"""Prefill side of the hand-off: compute the prompt, push its KV to D, keep it until D acknowledges.

Life cycle of a request here, by the names used below (`Outgoing.stage`):
  1. `waiting_ready`  — Prefill arrived; the engine computes at once; KVWant went to D. Frames are
                        not sent until D answers KVReady (its blocks are reserved).
  2. `streaming`      — D is ready: the backlog (layers already computed) is sent from the cache,
                        then every layer's KV is sent from the layer hook as soon as it exists.
                        Tokens before KVReady.have_tokens (D's own cached prefix) are never sent,
                        nor, on a sliding-window layer, those before D's first query's window
                        (`ModelArch.kv_needed_from`; this worker still holds those).
  3. `done_sent`      — the hand-off tokens are sampled, all frames and KVDone are out; the blocks
                        stay held (lease) until KVAck, KVFail, or the lease runs out (reclaimed,
                        counted, reported).
The first token goes to the requester as soon as it is sampled, before any of this completes.
Every stage has a deadline; on any failure both D and the requester are told.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch
import zmq

from pdserve.engine.model_runner import RowSpan
from pdserve.engine.request import SamplingParams
from pdserve.transfer import wire
from pdserve.transfer.transports import FRAME, MSG, SHM_FRAME, ShmRing, connect_sender
from pdserve.workers import messages as m
from pdserve.workers.side_host import SideHost


@dataclass
class Outgoing:
    rid: str
    dest_worker: str
    sock: zmq.Socket
    params: SamplingParams  # the client's parameters (P runs with max_tokens = hand-off tokens)
    started: float
    stage: str = "waiting_ready"
    next_token: list[int] = field(default_factory=list)  # per layer: first token not yet sent
    frames: int = 0
    nbytes: int = 0
    done_at: float = 0.0
    finished_local: bool = False  # the hand-off tokens are sampled; KVDone may go out
    times: dict[str, float] = field(default_factory=dict)


@dataclass
class Fault:
    """Injected faults on outgoing frames (tests, chaos): drop, delay or corrupt N frames."""

    mode: str = "none"
    remaining: int = 0
    delay_s: float = 0.0

    def take(self) -> str:
        if self.mode == "none" or self.remaining == 0:
            return "none"
        if self.remaining > 0:
            self.remaining -= 1
        return self.mode


class PrefillSide:
    def __init__(self, worker: SideHost) -> None:
        self.w = worker
        self.out: dict[str, Outgoing] = {}
        self.senders: dict[str, zmq.Socket] = {}  # endpoint -> DEALER
        self.fault = Fault()
        self.delayed: list[tuple[float, zmq.Socket, list]] = []
        self.ring = ShmRing(worker.shm_bytes) if worker.transport == "shm" else None
        worker.engine.runner.layer_hook = self.on_layer

    # ---- intake --------------------------------------------------------------------------
    def start(self, msg: m.Prefill, client: bytes) -> None:
        params = m.sampling_params(msg.params)
        handoff = max(1, msg.handoff_tokens)
        local = m.sampling_params({**msg.params, "max_tokens": min(handoff, params.max_tokens)})
        self.w.engine.add_request(msg.prompt_ids, local, msg.rid, hold_kv=True)
        sock = self._sender(msg.dest_endpoint)
        arch = self.w.engine.arch
        # D continues after the hand-off's KV tokens (D counts them the same way): a sliding
        # layer gets only the last `window - 1` of them, all D's first query there can see.
        num_kv = len(msg.prompt_ids) + handoff - 1
        now = time.monotonic()
        self.out[msg.rid] = Outgoing(
            msg.rid,
            msg.dest_worker,
            sock,
            params,
            now,
            next_token=[arch.kv_needed_from(i, num_kv) for i in range(arch.num_layers)],
            times={"received": now},
        )
        self.w.clients[msg.rid] = client
        self._send_msg(sock, m.KVWant(msg.rid, self.w.worker_id))

    def _sender(self, endpoint: str) -> zmq.Socket:
        sock = self.senders.get(endpoint)
        if sock is None:
            sock = connect_sender(self.w.ctx, endpoint, self.w.worker_id)
            self.w.poller.register(sock, zmq.POLLIN)
            self.senders[endpoint] = sock
        return sock

    # ---- messages from D -----------------------------------------------------------------
    def on_message(self, msg: object) -> None:
        if isinstance(msg, m.KVReady):
            self._on_ready(msg.rid, msg.have_tokens)
        elif isinstance(msg, m.KVAck):
            self._on_ack(msg.rid)
        elif isinstance(msg, m.KVFail):
            o = self.out.get(msg.rid)
            if o is not None:
                self.fail(o, f"decode worker {o.dest_worker}: {msg.reason}", tell_dest=False)

    def _on_ready(self, rid: str, have_tokens: int = 0) -> None:
        o = self.out.get(rid)
        if o is None or o.stage != "waiting_ready":
            return
        self._skip_cached(o, have_tokens)
        o.stage, o.times["ready"] = "streaming", time.monotonic()
        if o.finished_local:
            self._send_done(o)
        elif self.w.stream_kv:
            self._send_backlog(o)

    def _skip_cached(self, o: Outgoing, have_tokens: int) -> None:
        """D already holds the KV of the first `have_tokens` tokens: start every layer there.

        D leaves at least the last prompt token to us; a larger claim is capped, so what we send
        then starts before D's claim and D's own checks fail the hand-off (never failed from
        here: this may run inside an engine step, from the layer hook)."""
        request = self.w.engine.scheduler.requests.get(o.rid) or self.w.engine.held_request(o.rid)
        limit = request.num_prompt_tokens - 1 if request is not None else 0
        skip = max(0, min(have_tokens, limit))
        o.next_token = [max(n, skip) for n in o.next_token]
        self.w.counters["kv_tokens_skipped"] += skip

    def _send_backlog(self, o: Outgoing) -> None:
        """Send from the cache every layer's KV computed (in finished steps) before D was ready."""
        eng = self.w.engine
        request = eng.scheduler.requests.get(o.rid) or eng.scheduler.held.get(o.rid)
        if request is None:
            return
        for layer in range(eng.arch.num_layers):
            if o.next_token[layer] < request.num_computed_tokens:
                self._send_from_cache(o, layer, request.num_computed_tokens)

    def _on_ack(self, rid: str) -> None:
        o = self.out.pop(rid, None)
        if o is None:
            return
        self.w.engine.release_kv(rid)
        self._release_ring(rid)
        self.w.counters["handoffs_acked"] += 1
        o.times["acked"] = time.monotonic()
        self.w.emit(
            rid,
            m.TransferReport(
                rid,
                self.w.worker_id,
                "send",
                o.frames,
                o.nbytes,
                time.monotonic() - o.started,
                self.w.kv_codec,
                o.times,
            ),
        )

    # ---- streaming -----------------------------------------------------------------------
    def on_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, spans: list[RowSpan]) -> None:
        """Layer hook: send this layer's fresh KV of every streaming request in the batch.

        D's KVReady usually lands while a long prompt is computing, so the hook also polls for
        it; layers of this step computed before it came are caught up from the cache.
        """
        if not self.w.stream_kv:
            return  # everything goes after the prefill (the baseline streaming is measured against)
        if any(o.stage == "waiting_ready" for o in self.out.values()):
            self.poll_ready()
        for span in spans:
            o = self.out.get(span.request_id)
            if o is None or o.stage != "streaming":
                continue
            end = span.start_pos + span.num_tokens
            for earlier in range(layer):
                if o.next_token[earlier] < end:
                    self._send_from_cache(o, earlier, end)
            # Only rows at or after next_token: D may hold the start (its cached prefix). A gap
            # before the span (not sent yet) is caught up from the cache by the next hook.
            first = o.next_token[layer]
            if span.start_pos <= first < end:
                rows = slice(span.row + first - span.start_pos, span.row + span.num_tokens)
                self._send_frame(o, layer, first, k[rows], v[rows])

    def poll_ready(self) -> None:
        """Mid-step: act on KVReady at once; anything else waits until the step is over."""
        for sock in self.senders.values():
            while True:
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self.w.on_kv_reply(parts, mid_step=True)

    def _send_from_cache(self, o: Outgoing, layer: int, end: int) -> None:
        eng = self.w.engine
        start = o.next_token[layer]
        slots = eng.kv_slots(eng.kv_manager.get_block_ids(o.rid), start, end)
        k, v = eng.read_kv(slots, layer)
        self._send_frame(o, layer, start, k, v)

    def _send_frame(
        self, o: Outgoing, layer: int, token_start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        parts = wire.encode_frame(
            o.rid, layer, token_start, [k], [v], self.w.kv_codec, self.w.fingerprint
        )
        o.next_token[layer] = token_start + k.shape[0]
        o.frames += 1
        o.nbytes += wire.frame_nbytes(parts)
        fault = self.fault.take()
        if fault != "none":
            self.w.counters["faults_injected"] += 1
        if fault == "drop":
            return
        if fault == "corrupt":
            payload = bytearray(b"".join(bytes(p) for p in parts[1:]))
            payload[random.randrange(len(payload))] ^= 0x10
            parts = [parts[0], bytes(payload)]
        packed = self._pack(o.rid, parts)
        if fault == "delay":
            self.delayed.append((time.monotonic() + self.fault.delay_s, o.sock, packed))
            return
        self._send_parts(o.sock, packed)

    def _pack(self, rid: str, parts: list) -> list:
        """Multipart for the link: payload inline, or written to the shared-memory ring."""
        if self.ring is not None:
            ref = self.ring.put(rid, parts[1:])
            if ref is not None:
                return [SHM_FRAME, parts[0], ref]
            self.w.counters["shm_inline_frames"] += 1
        return [FRAME, *parts]

    def _send_parts(self, sock: zmq.Socket, parts: list) -> None:
        if any(d[1] is sock for d in self.delayed):  # a slow link delays what follows, in order
            self.delayed.append((0.0, sock, parts))
            return
        try:
            # never block the main loop on a dead or wedged D: its queue (SNDHWM messages)
            # fills and the frame is dropped; D's completeness check then fails the hand-off,
            # and the router retries or recovers the request
            sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.w.counters["kv_sends_dropped"] += 1

    def _send_msg(self, sock: zmq.Socket, msg: object) -> None:
        self._send_parts(sock, [MSG, m.encode(msg)])

    # ---- after each engine step ----------------------------------------------------------
    def on_finished(self, rid: str, handoff: bool, times: dict[str, float]) -> None:
        """The engine finished `rid` here: hand it over, or (finished for real) let it go."""
        o = self.out.get(rid)
        if o is None:
            return
        o.times.update(times)
        if not handoff:
            self.out.pop(rid)
            self.w.engine.release_kv(rid)
            self._release_ring(rid)
            self._send_msg(o.sock, m.KVFail(rid, "finished on the prefill worker"))
            return
        o.finished_local = True
        if o.stage == "streaming":
            self._send_done(o)

    def _send_done(self, o: Outgoing) -> None:
        held = self.w.engine.held_request(o.rid)
        if held is None:
            return
        self._send_backlog(o)  # tokens computed by decode steps on P (hand-off after k > 1)
        done = m.KVDone(
            o.rid,
            list(held.output_token_ids),
            held.num_computed_tokens,
            o.frames,
            list(held.fork_tokens),
        )
        self._send_msg(o.sock, done)
        o.stage, o.done_at = "done_sent", time.monotonic()
        o.times["done_sent"] = o.done_at

    def flush_delayed(self) -> None:
        """Send delayed parts whose time has come, keeping each link's order."""
        now, keep, blocked = time.monotonic(), [], set()
        for due, sock, parts in self.delayed:
            if id(sock) in blocked or due > now:
                blocked.add(id(sock))
                keep.append((due, sock, parts))
            else:
                sock.send_multipart(parts, copy=False)
        self.delayed = keep

    def check_deadlines(self, now: float) -> None:
        for o in list(self.out.values()):
            if o.stage == "waiting_ready" and now - o.started > self.w.deadline_s:
                self.fail(
                    o,
                    f"decode worker {o.dest_worker} did not reserve KV blocks within "
                    f"{self.w.deadline_s:g}s",
                )
            elif o.stage == "done_sent" and now - o.done_at > self.w.lease_s:
                # After KVDone, D owns the request: it may be decoding already and only the ack
                # was lost. Reclaim our copy and tell D; D fails the request if it had not
                # admitted it, so the requester hears from the one worker that knows.
                self.w.counters["lease_reclaims"] += 1
                reason = (
                    f"no acknowledgement from decode worker {o.dest_worker} within the "
                    f"{self.w.lease_s:g}s lease; KV reclaimed"
                )
                self.w.log.warning("%s: %s", o.rid, reason)
                self.fail(o, reason, tell_client=False)

    def fail(
        self, o: Outgoing, reason: str, tell_dest: bool = True, tell_client: bool = True
    ) -> None:
        self.out.pop(o.rid, None)
        self.w.engine.abort_request(o.rid)
        self._release_ring(o.rid)
        self.w.counters["transfer_failures"] += 1
        if tell_dest:
            self._send_msg(o.sock, m.KVFail(o.rid, reason))
        if tell_client:
            self.w.emit(o.rid, m.RequestFailed(o.rid, self.w.worker_id, reason, "transfer"))
        self.w.clients.pop(o.rid, None)

    def abort(self, rid: str) -> None:
        o = self.out.pop(rid, None)
        if o is not None:
            self._release_ring(rid)
            self._send_msg(o.sock, m.KVFail(rid, "aborted"))

    def _release_ring(self, rid: str) -> None:
        if self.ring is not None:
            self.ring.release(rid)

    def close(self) -> None:
        for sock in self.senders.values():
            sock.close(0)
        if self.ring is not None:
            self.ring.close()
