"""The P and D sides of the hand-off (workers/prefill.py, decode.py) on real engines over the
in-memory link (transfer/fake.py): no worker, no socket, no thread. P's side sends, D's side
polls; `Pair.turn` runs what each worker's loop runs around its engine step (worker.py
`run_once`)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from factories import assert_engine_idle
from pdserve import LLM, SamplingParams
from pdserve.transfer.api import LinkSetup
from pdserve.transfer.fake import FakeNetwork, FakeSender
from pdserve.workers import messages as m
from pdserve.workers.context import HandoffSettings, WorkerContext
from pdserve.workers.decode import DecodeSide
from pdserve.workers.prefill import PrefillSide, SendStage

MAX_TOKENS = 6
PARAMS = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (3, 37)]


@pytest.fixture(scope="module")
def llms(tiny_llama_path: Any) -> tuple[LLM, LLM, list[list[int]]]:
    """A P engine, a D engine of another block size, and the colocated greedy reference."""
    p, d = LLM(str(tiny_llama_path), block_size=4), LLM(str(tiny_llama_path), block_size=8)
    ref = d.generate(_prompts(), SamplingParams(**PARAMS))
    return p, d, [o.outputs[0].token_ids for o in ref]


class Pair:
    """P0 and D0: the sides of two workers, joined by a fake link."""

    def __init__(self, p: LLM, d: LLM, **settings: Any) -> None:
        net = FakeNetwork()
        fingerprint = p.engine.kv_layout.fingerprint()
        self.emitted: dict[str, list[object]] = {"P0": [], "D0": []}
        self.tokens: dict[str, list[int]] = {}  # request -> D's final token ids

        def context(worker_id: str, llm: LLM) -> WorkerContext:
            emit = self.emitted[worker_id]
            return WorkerContext(
                worker_id,
                llm.engine,
                HandoffSettings(fingerprint, **settings),
                lambda rid, msg: emit.append(msg),
            )

        self.p_eng, self.d_eng = p.engine, d.engine
        self.p = PrefillSide(context("P0", p), net.sender(LinkSetup("P0")))
        self.d = DecodeSide(context("D0", d), net.receiver(LinkSetup("D0")))

    def submit(self, rid: str, prompt: list[int]) -> None:
        """What the router sends: ExpectKV to D, Prefill to P."""
        self.d.expect(m.ExpectKV(rid, prompt, PARAMS, "P0"), b"client")
        self.p.start(m.Prefill(rid, prompt, PARAMS, "D0", self.d.link.endpoint), b"client")

    def turn(self) -> None:
        now = time.monotonic()
        self.d.poll()
        self.p.poll()
        if self.p_eng.has_unfinished_requests():
            for out in self.p_eng.step():
                if out.finished:  # P stops at the hand-off (max_tokens = hand-off tokens)
                    self.p.on_finished(out.request_id, out.request_id in self.p.out, {})
        self.p.run_deferred()
        if self.d_eng.has_unfinished_requests():
            for out in self.d_eng.step():
                if out.finished:
                    self.tokens[out.request_id] = out.outputs[0].token_ids
        self.p.flush_delayed()
        self.p.check_deadlines(now)
        self.d.check_deadlines(now)

    def run(self, until: Any, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, "the hand-off did not settle"
            self.turn()

    def settled(self) -> bool:
        return not (self.p.out or self.d.inc or self.p.delayed) and not (
            self.p_eng.has_unfinished_requests() or self.d_eng.has_unfinished_requests()
        )

    def emitted_of(self, worker_id: str, kind: type) -> list[Any]:
        return [msg for msg in self.emitted[worker_id] if isinstance(msg, kind)]


def test_p_sends_d_polls_and_decodes_the_colocated_tokens(llms: Any) -> None:
    p, d, reference = llms
    pair = Pair(p, d)
    for i, prompt in enumerate(_prompts()):
        pair.submit(f"r{i}", prompt)
    pair.run(pair.settled)
    assert [pair.tokens[f"r{i}"] for i in range(len(reference))] == reference
    sent = {r.rid: r for r in pair.emitted_of("P0", m.TransferReport)}
    received = {r.rid: r for r in pair.emitted_of("D0", m.TransferReport)}
    assert sent.keys() == received.keys() == {"r0", "r1"}
    assert all(sent[r].frames == received[r].frames > 0 for r in sent)
    assert isinstance(pair.p.link, FakeSender) and not pair.p.link.held  # done for each
    assert pair.d.ctx.counters["handoffs_received"] == 2
    assert_engine_idle(p)
    assert_engine_idle(d)


def test_a_corrupt_frame_fails_the_handoff_on_both_sides(llms: Any) -> None:
    p, d, _ = llms
    pair = Pair(p, d)
    pair.p.fault.mode, pair.p.fault.remaining = "corrupt", 1
    pair.submit("bad", _prompts()[1])
    pair.run(pair.settled)
    assert pair.d.ctx.counters["bad_frames"] == 1
    assert [f.stage for f in pair.emitted_of("D0", m.RequestFailed)] == ["transfer"]
    assert "bad KV frame" in pair.emitted_of("D0", m.RequestFailed)[0].reason
    assert pair.p.ctx.counters["transfer_failures"] == 1  # told by D's KVFail
    assert_engine_idle(p)
    assert_engine_idle(d)


def test_a_lost_ack_is_reclaimed_by_the_lease_and_d_still_decodes(llms: Any) -> None:
    p, d, reference = llms
    pair = Pair(p, d, lease_s=0.2)
    pair.d.drop_acks = 1
    pair.submit("r0", _prompts()[0])
    pair.run(lambda: pair.d.ctx.counters["faults_injected"] == 1)  # the ack, dropped
    assert pair.p.out["r0"].stage == SendStage.DONE_SENT  # waiting for it
    pair.run(pair.settled)
    assert pair.tokens["r0"] == reference[0]
    assert pair.p.ctx.counters["lease_reclaims"] == 1
    assert_engine_idle(p)
    assert_engine_idle(d)
