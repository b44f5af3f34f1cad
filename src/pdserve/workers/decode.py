"""Decode side of the hand-off: reserve blocks, receive KV frames into them, admit, generate.

Life cycle of a request here, by the names used below (`Incoming.stage`, a `ReceiveStage`):
  1. `reserving`  — ExpectKV arrived; blocks for the prompt's KV are reserved (retried each loop
                    while memory is short, until the deadline); the prompt's cached prefix here
                    is reused (`have_tokens`, whole blocks), so only the rest must arrive;
  2. `receiving`  — reserved and P's KVWant seen: KVReady(have_tokens) went to P; frames are
                    checked (checksum, layout fingerprint, ranges in order per layer, nothing
                    before have_tokens, a sliding layer's from its window's start, where P
                    starts it) and written into the blocks;
  3. admitted     — KVDone arrived and every layer holds every token: the engine admits the
                    request with num_computed_tokens = KV tokens; KVAck releases P's blocks.
Any bad frame, silence longer than the deadline, or KVFail from P cancels the reservation and tells
both P and the requester. Nothing here waits without a deadline.

Frames and messages arrive through this worker's `KVReceiver` (transfer/api.py), which hands them
to this side (`poll`: `on_frame`, `on_message`); answers to P go back by `reply`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from pdserve.engine.request import SamplingParams
from pdserve.transfer import wire
from pdserve.transfer.api import KVReceiver
from pdserve.transfer.wire import Part
from pdserve.workers import messages as m
from pdserve.workers.context import WorkerContext


class ReceiveStage(StrEnum):
    RESERVING = "reserving"
    RECEIVING = "receiving"


@dataclass
class Incoming:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    src_worker: str
    num_kv_tokens: int
    client: bytes
    last_activity: float
    stage: ReceiveStage = ReceiveStage.RESERVING
    peer: bytes | None = None  # P's identity on the KV socket, once KVWant arrived
    slots: list[torch.Tensor] | None = None  # per KV group (engine.block_tables)
    next_token: list[int] = field(default_factory=list)
    have_tokens: int = 0  # leading tokens whose KV was already cached here: P skips them
    frames: int = 0
    nbytes: int = 0
    started: float = 0.0
    times: dict[str, float] = field(default_factory=dict)
    conversation: str | None = None  # keep the KV for the conversation's next turn


class DecodeSide:
    def __init__(self, ctx: WorkerContext, link: KVReceiver) -> None:
        self.ctx, self.link, self.settings = ctx, link, ctx.settings
        self.inc: dict[str, Incoming] = {}
        self.early_wants: dict[str, tuple[bytes, float]] = {}  # KVWant before ExpectKV
        self.drop_acks = 0  # fault injection: acknowledgements to swallow (-1: all)

    # ---- intake --------------------------------------------------------------------------
    def expect(self, msg: m.ExpectKV, client: bytes) -> None:
        params = m.sampling_params(msg.params)
        n_kv = len(msg.prompt_ids) + max(1, msg.handoff_tokens) - 1
        now = time.monotonic()
        inc = Incoming(
            msg.rid,
            list(msg.prompt_ids),
            params,
            msg.src_worker,
            n_kv,
            client,
            now,
            next_token=[0] * self.ctx.engine.arch.num_layers,
            started=now,
            times={"expect": now},
            conversation=msg.conversation or None,
        )
        if msg.rid in self.inc or msg.rid in self.ctx.engine._live:
            raise ValueError(f"request id {msg.rid!r} is already in use")
        self.inc[msg.rid] = inc
        self.ctx.clients[msg.rid] = client
        early = self.early_wants.pop(msg.rid, None)
        if early is not None:
            inc.peer = early[0]
        self._try_reserve(inc)

    def _try_reserve(self, inc: Incoming) -> None:
        eng = self.ctx.engine
        try:
            blocks = eng.reserve_kv(inc.prompt_ids, inc.params, inc.rid, inc.num_kv_tokens)
        except ValueError as e:
            self.fail(inc, f"cannot admit: {e}", stage="admission")  # permanent: no retry
            return
        if blocks is None:
            return  # memory short: retried each loop until the deadline
        if inc.conversation:
            eng.mark_turn(inc.rid, inc.conversation)
        # each layer's KV goes to its KV group's blocks (a sliding layer's own, hybrid_kv.py)
        inc.slots = [eng.kv_slots(t, 0, inc.num_kv_tokens) for t in eng.block_tables(inc.rid)]
        inc.have_tokens = blocks.cached_tokens
        # P sends a sliding layer only its window (ModelArch.kv_needed_from), as expected here
        arch, n = eng.arch, inc.num_kv_tokens
        inc.next_token = [
            max(inc.have_tokens, arch.kv_needed_from(i, n)) for i in range(arch.num_layers)
        ]
        inc.stage, inc.times["reserved"] = ReceiveStage.RECEIVING, time.monotonic()
        self._maybe_ready(inc)

    def _maybe_ready(self, inc: Incoming) -> None:
        if inc.stage == ReceiveStage.RECEIVING and inc.peer is not None:
            self._send(inc.peer, m.KVReady(inc.rid, inc.have_tokens))

    # ---- the KV link ---------------------------------------------------------------------
    def poll(self) -> None:
        """Each loop turn: take what P workers sent (frames, messages) from the link."""
        self.link.poll(self)

    def on_message(self, peer: bytes, data: Part) -> None:
        msg = self.ctx.decode_link_message(data)
        if msg is not None:
            self._on_message(peer, msg)

    def _on_message(self, peer: bytes, msg: object) -> None:
        if isinstance(msg, m.KVWant):
            inc = self.inc.get(msg.rid)
            if inc is None:
                self.early_wants[msg.rid] = (peer, time.monotonic())
                return
            inc.peer, inc.last_activity = peer, time.monotonic()
            self._maybe_ready(inc)
        elif isinstance(msg, m.KVDone):
            inc = self.inc.get(msg.rid)
            if inc is not None:
                self._on_done(inc, msg)
        elif isinstance(msg, m.KVFail):
            inc = self.inc.get(msg.rid)
            if inc is not None:
                self.fail(inc, f"prefill worker {inc.src_worker}: {msg.reason}", tell_src=False)

    def on_frame(self, peer: bytes, parts: Sequence[Part]) -> None:
        try:
            head = wire.peek_header(parts)
        except wire.WireError as e:
            self.ctx.counters["bad_frames"] += 1
            self.ctx.log.warning("dropping a malformed KV frame from %r: %s", peer, e)
            return
        inc = self.inc.get(head.request_id)
        if inc is None or inc.stage != ReceiveStage.RECEIVING or inc.peer != peer:
            self.ctx.counters["stray_frames"] += 1
            return
        try:
            self._store(inc, wire.decode_frame(parts, fingerprint=self.settings.fingerprint))
        except ValueError as e:
            self.ctx.counters["bad_frames"] += 1
            self.fail(inc, f"bad KV frame: {e}")

    def _store(self, inc: Incoming, frame: wire.Frame) -> None:
        h = frame.header
        if h.token_end > inc.num_kv_tokens or h.layer_end > len(inc.next_token):
            raise ValueError(
                f"frame range beyond the request ({h.token_end} tokens, layer {h.layer_end})"
            )
        if h.token_start < inc.have_tokens:
            raise ValueError(
                f"frame from token {h.token_start}, but the first {inc.have_tokens} are cached "
                "here (KVReady.have_tokens)"
            )
        assert inc.slots is not None
        groups = self.ctx.engine.cache.layer_group
        for layer, k, v in frame.layers():
            if inc.next_token[layer] != h.token_start:
                raise ValueError(
                    f"layer {layer}: tokens from {h.token_start}, expected {inc.next_token[layer]}"
                )
            slots = inc.slots[groups[layer]][h.token_start : h.token_end]
            self.ctx.engine.write_kv(slots, layer, k, v)
            inc.next_token[layer] = h.token_end
        inc.frames += 1
        inc.nbytes += h.payload_len
        inc.last_activity = time.monotonic()
        inc.times.setdefault("first_frame", inc.last_activity)

    def _on_done(self, inc: Incoming, msg: m.KVDone) -> None:
        complete = all(n == inc.num_kv_tokens for n in inc.next_token)
        if (
            inc.stage != ReceiveStage.RECEIVING
            or msg.num_kv_tokens != inc.num_kv_tokens
            or not complete
            or msg.frames != inc.frames
        ):
            self.fail(
                inc,
                f"incomplete KV: {inc.frames}/{msg.frames} frames, "
                f"{min(inc.next_token)}/{inc.num_kv_tokens} tokens",
            )
            return
        del self.inc[inc.rid]
        inc.times["done"] = time.monotonic()
        eng = self.ctx.engine
        try:
            eng.admit_prefilled(inc.rid, msg.output_ids, inc.num_kv_tokens, msg.fork_ids)
        except ValueError as e:
            self.ctx.emit(
                inc.rid, m.RequestFailed(inc.rid, self.ctx.worker_id, str(e), "admission")
            )
            return
        assert inc.peer is not None
        self._send(inc.peer, m.KVAck(inc.rid))
        self.ctx.counters["handoffs_received"] += 1
        self.ctx.counters["kv_tokens_reused"] += inc.have_tokens
        self.ctx.emit(
            inc.rid,
            m.TransferReport(
                inc.rid,
                self.ctx.worker_id,
                "recv",
                inc.frames,
                inc.nbytes,
                time.monotonic() - inc.started,
                self.settings.kv_codec,
                inc.times,
                cached=inc.have_tokens,
            ),
        )

    # ---- deadlines and failures ----------------------------------------------------------
    def check_deadlines(self, now: float) -> None:
        for inc in list(self.inc.values()):
            if inc.stage == ReceiveStage.RESERVING:
                self._try_reserve(inc)
            limit = self._limit(inc)
            if inc.rid in self.inc and now - inc.last_activity > limit:
                what = "KV blocks" if inc.stage == ReceiveStage.RESERVING else "KV frames"
                self.fail(inc, f"no progress on {what} for {limit:g}s")
        for rid, (_, t) in list(self.early_wants.items()):
            if now - t > self.settings.deadline_s:
                del self.early_wants[rid]

    def _limit(self, inc: Incoming) -> float:
        """Seconds of silence a hand-off may keep. Until its first frame, `kv_wait_s`: P sends
        a prompt's frames as it computes it, after the prompts queued ahead of it there, and
        its loop does not turn inside a step (one step of a 2000-token prompt on one thread:
        ~8 s). With `deadline_s` alone, KB-QA on 1P1D failed the second prompt of a burst at
        5 s, re-queued it on P and counted a retry. A P that dies or sticks is the router's to
        detect; it aborts the reservation here."""
        if inc.stage == ReceiveStage.RECEIVING and "first_frame" not in inc.times:
            return self.settings.kv_wait_s
        return self.settings.deadline_s

    def fail(
        self, inc: Incoming, reason: str, tell_src: bool = True, stage: str = "transfer"
    ) -> None:
        self.inc.pop(inc.rid, None)
        self.ctx.engine.cancel_reserved(inc.rid)
        self.ctx.counters["transfer_failures"] += 1
        if tell_src and inc.peer is not None:
            self._send(inc.peer, m.KVFail(inc.rid, reason))
        self.ctx.emit(inc.rid, m.RequestFailed(inc.rid, self.ctx.worker_id, reason, stage))
        self.ctx.clients.pop(inc.rid, None)

    def abort(self, rid: str) -> None:
        inc = self.inc.pop(rid, None)
        if inc is not None:
            self.ctx.engine.cancel_reserved(rid)
            if inc.peer is not None:
                self._send(inc.peer, m.KVFail(rid, "aborted"))
        self.early_wants.pop(rid, None)

    def _send(self, peer: bytes, msg: object) -> None:
        if isinstance(msg, m.KVAck) and self.drop_acks != 0:  # injected fault: a lost ack
            self.drop_acks -= 1
            self.ctx.counters["faults_injected"] += 1
            return
        try:
            self.link.reply(peer, m.encode(msg))
        except Exception as e:  # KVLinkError: the peer is gone
            self.ctx.log.warning("cannot reach %r: %s", peer, e)

    def close(self) -> None:
        self.link.close()
