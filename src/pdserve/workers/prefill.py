"""Prefill side of the hand-off: compute the prompt, push its KV to D, keep it until D acknowledges.

Life cycle of a request here, by the names used below (`Outgoing.stage`, a `SendStage`):
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

Frames and messages go to D through this worker's `KVSender` (transfer/api.py); D's replies come
back from its `poll`, each loop turn and, for KVReady, mid-step from the layer hook.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from pdserve.engine.model_runner import RowSpan
from pdserve.engine.request import SamplingParams
from pdserve.transfer import wire
from pdserve.transfer.api import KVSender
from pdserve.transfer.wire import Part
from pdserve.workers import messages as m
from pdserve.workers.context import WorkerContext


class SendStage(StrEnum):
    WAITING_READY = "waiting_ready"
    STREAMING = "streaming"
    DONE_SENT = "done_sent"


@dataclass
class Outgoing:
    rid: str
    dest_worker: str
    dest: str  # D's KV endpoint
    params: SamplingParams  # the client's parameters (P runs with max_tokens = hand-off tokens)
    started: float
    stage: SendStage = SendStage.WAITING_READY
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
    def __init__(self, ctx: WorkerContext, link: KVSender) -> None:
        self.ctx, self.link, self.settings = ctx, link, ctx.settings
        self.out: dict[str, Outgoing] = {}
        self.fault = Fault()
        # (when, D's endpoint, the send) held back by a `delay` fault, in order per endpoint
        self.delayed: list[tuple[float, str, Callable[[], None]]] = []
        self.deferred: list[object] = []  # D's messages that arrived during a step
        ctx.engine.runner.layer_hook = self.on_layer

    # ---- intake --------------------------------------------------------------------------
    def start(self, msg: m.Prefill, client: bytes) -> None:
        params = m.sampling_params(msg.params)
        handoff = max(1, msg.handoff_tokens)
        local = m.sampling_params({**msg.params, "max_tokens": min(handoff, params.max_tokens)})
        self.ctx.engine.add_request(msg.prompt_ids, local, msg.rid, hold_kv=True)
        arch = self.ctx.engine.arch
        # D continues after the hand-off's KV tokens (D counts them the same way): a sliding
        # layer gets only the last `window - 1` of them, all D's first query there can see.
        num_kv = len(msg.prompt_ids) + handoff - 1
        now = time.monotonic()
        self.out[msg.rid] = Outgoing(
            msg.rid,
            msg.dest_worker,
            msg.dest_endpoint,
            params,
            now,
            next_token=[arch.kv_needed_from(i, num_kv) for i in range(arch.num_layers)],
            times={"received": now},
        )
        self.ctx.clients[msg.rid] = client
        self._send_msg(msg.dest_endpoint, m.KVWant(msg.rid, self.ctx.worker_id))

    # ---- messages from D -----------------------------------------------------------------
    def poll(self) -> None:
        """Each loop turn, between engine steps: act on what D workers sent back."""
        for data in self.link.poll():
            self.on_reply(data)

    def run_deferred(self) -> None:
        """After an engine step: act on what D sent during it (`on_reply` kept it for now)."""
        deferred, self.deferred = self.deferred, []
        for msg in deferred:
            self.on_message(msg)

    def on_reply(self, data: Part, mid_step: bool = False) -> None:
        """A message from a decode worker we push to. During an engine step (from the layer
        hook) only KVReady is acted on; the rest changes engine state and waits for the step."""
        msg = self.ctx.decode_link_message(data)
        if msg is None:
            return
        if mid_step and not isinstance(msg, m.KVReady):
            self.deferred.append(msg)
        else:
            self.on_message(msg)

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
        if o is None or o.stage != SendStage.WAITING_READY:
            return
        self._skip_cached(o, have_tokens)
        o.stage, o.times["ready"] = SendStage.STREAMING, time.monotonic()
        if o.finished_local:
            self._send_done(o)
        elif self.settings.stream_kv:
            self._send_backlog(o)

    def _skip_cached(self, o: Outgoing, have_tokens: int) -> None:
        """D already holds the KV of the first `have_tokens` tokens: start every layer there.

        D leaves at least the last prompt token to us; a larger claim is capped, so what we send
        then starts before D's claim and D's own checks fail the hand-off (never failed from
        here: this may run inside an engine step, from the layer hook)."""
        eng = self.ctx.engine
        request = eng.scheduler.requests.get(o.rid) or eng.held_request(o.rid)
        limit = request.num_prompt_tokens - 1 if request is not None else 0
        skip = max(0, min(have_tokens, limit))
        o.next_token = [max(n, skip) for n in o.next_token]
        self.ctx.counters["kv_tokens_skipped"] += skip

    def _send_backlog(self, o: Outgoing) -> None:
        """Send from the cache every layer's KV computed (in finished steps) before D was ready."""
        eng = self.ctx.engine
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
        self.ctx.engine.release_kv(rid)
        self.link.done(rid)
        self.ctx.counters["handoffs_acked"] += 1
        o.times["acked"] = time.monotonic()
        self.ctx.emit(
            rid,
            m.TransferReport(
                rid,
                self.ctx.worker_id,
                "send",
                o.frames,
                o.nbytes,
                time.monotonic() - o.started,
                self.settings.kv_codec,
                o.times,
            ),
        )

    # ---- streaming -----------------------------------------------------------------------
    def on_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, spans: list[RowSpan]) -> None:
        """Layer hook: send this layer's fresh KV of every streaming request in the batch.

        D's KVReady usually lands while a long prompt is computing, so the hook also polls for
        it; layers of this step computed before it came are caught up from the cache.
        """
        if not self.settings.stream_kv:
            return  # everything goes after the prefill (the baseline streaming is measured against)
        if any(o.stage == SendStage.WAITING_READY for o in self.out.values()):
            self.poll_ready()
        for span in spans:
            o = self.out.get(span.request_id)
            if o is None or o.stage != SendStage.STREAMING:
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
        for data in self.link.poll():
            self.on_reply(data, mid_step=True)

    def _send_from_cache(self, o: Outgoing, layer: int, end: int) -> None:
        eng = self.ctx.engine
        start = o.next_token[layer]
        slots = eng.layer_slots(o.rid, layer, start, end)  # from the layer's KV group
        k, v = eng.read_kv(slots, layer)
        self._send_frame(o, layer, start, k, v)

    def _send_frame(
        self, o: Outgoing, layer: int, token_start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        parts = wire.encode_frame(
            o.rid, layer, token_start, [k], [v], self.settings.kv_codec, self.settings.fingerprint
        )
        o.next_token[layer] = token_start + k.shape[0]
        o.frames += 1
        o.nbytes += wire.frame_nbytes(parts)
        fault = self.fault.take()
        if fault != "none":
            self.ctx.counters["faults_injected"] += 1
        if fault == "drop":
            return
        if fault == "corrupt":
            payload = bytearray(b"".join(bytes(p) for p in parts[1:]))
            payload[random.randrange(len(payload))] ^= 0x10
            parts = [parts[0], bytes(payload)]

        def send() -> None:
            self.link.send_layer(o.dest, o.rid, parts)

        if fault == "delay":
            self.delayed.append((time.monotonic() + self.fault.delay_s, o.dest, send))
            return
        self._send(o.dest, send)

    def _send(self, dest: str, send: Callable[[], None]) -> None:
        if any(d[1] == dest for d in self.delayed):  # a slow link delays what follows, in order
            self.delayed.append((0.0, dest, send))
            return
        send()

    def _send_msg(self, dest: str, msg: object) -> None:
        data = m.encode(msg)
        self._send(dest, lambda: self.link.send(dest, data))

    # ---- after each engine step ----------------------------------------------------------
    def on_finished(self, rid: str, handoff: bool, times: dict[str, float]) -> None:
        """The engine finished `rid` here: hand it over, or (finished for real) let it go."""
        o = self.out.get(rid)
        if o is None:
            return
        o.times.update(times)
        if not handoff:
            self.out.pop(rid)
            self.ctx.engine.release_kv(rid)
            self.link.done(rid)
            self._send_msg(o.dest, m.KVFail(rid, "finished on the prefill worker"))
            return
        o.finished_local = True
        if o.stage == SendStage.STREAMING:
            self._send_done(o)

    def _send_done(self, o: Outgoing) -> None:
        held = self.ctx.engine.held_request(o.rid)
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
        self._send_msg(o.dest, done)
        o.stage, o.done_at = SendStage.DONE_SENT, time.monotonic()
        o.times["done_sent"] = o.done_at

    def flush_delayed(self) -> None:
        """Send delayed parts whose time has come, keeping each link's order."""
        now, keep, blocked = time.monotonic(), [], set()
        for due, dest, send in self.delayed:
            if dest in blocked or due > now:
                blocked.add(dest)
                keep.append((due, dest, send))
            else:
                send()
        self.delayed = keep

    def check_deadlines(self, now: float) -> None:
        deadline_s, lease_s = self.settings.deadline_s, self.settings.lease_s
        for o in list(self.out.values()):
            if o.stage == SendStage.WAITING_READY and now - o.started > deadline_s:
                self.fail(
                    o,
                    f"decode worker {o.dest_worker} did not reserve KV blocks within "
                    f"{deadline_s:g}s",
                )
            elif o.stage == SendStage.DONE_SENT and now - o.done_at > lease_s:
                # After KVDone, D owns the request: it may be decoding already and only the ack
                # was lost. Reclaim our copy and tell D; D fails the request if it had not
                # admitted it, so the requester hears from the one worker that knows.
                self.ctx.counters["lease_reclaims"] += 1
                reason = (
                    f"no acknowledgement from decode worker {o.dest_worker} within the "
                    f"{lease_s:g}s lease; KV reclaimed"
                )
                self.ctx.log.warning("%s: %s", o.rid, reason)
                self.fail(o, reason, tell_client=False)

    def fail(
        self, o: Outgoing, reason: str, tell_dest: bool = True, tell_client: bool = True
    ) -> None:
        self.out.pop(o.rid, None)
        self.ctx.engine.abort_request(o.rid)
        self.link.done(o.rid)
        self.ctx.counters["transfer_failures"] += 1
        if tell_dest:
            self._send_msg(o.dest, m.KVFail(o.rid, reason))
        if tell_client:
            self.ctx.emit(o.rid, m.RequestFailed(o.rid, self.ctx.worker_id, reason, "transfer"))
        self.ctx.clients.pop(o.rid, None)

    def abort(self, rid: str) -> None:
        o = self.out.pop(rid, None)
        if o is not None:
            self.link.done(rid)
            self._send_msg(o.dest, m.KVFail(rid, "aborted"))

    def close(self) -> None:
        self.link.close()
