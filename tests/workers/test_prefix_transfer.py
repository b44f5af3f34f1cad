"""Real workers: D reuses its prefix cache in a hand-off (P sends only what D lacks), and every
client that says Hello gets the worker's prefix-cache events (snapshot, then deltas)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import zmq

from factories import assert_cluster_idle
from pdserve import LLM, SamplingParams
from pdserve.cluster import LocalCluster
from pdserve.engine.block_pool import hash_full_blocks
from pdserve.router.prefix_index import PrefixIndex
from pdserve.workers import messages as m

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
D_BLOCK = 8
SHARED = 3 * D_BLOCK  # three full blocks on D


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(33)
    shared = torch.randint(3, 49000, (SHARED,), generator=g).tolist()
    return [shared + torch.randint(3, 49000, (n,), generator=g).tolist() for n in (5, 9)]


@pytest.fixture(scope="module")
def reference(tiny_llama_path) -> list[list[int]]:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_llama_path), block_size=D_BLOCK)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]


def _subscribe(c: LocalCluster, worker_id: str) -> zmq.Socket:
    """A router-like client: Hello, then WorkerInfo and the snapshot come back."""
    w = next(w for w in c.workers if w.worker_id == worker_id)
    sock = c.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(w.launched.control)
    sock.send(m.encode(m.Hello("test-subscriber")))
    assert isinstance(_recv(sock), m.WorkerInfo)
    return sock


def _recv(sock: zmq.Socket, timeout_s: float = 10.0) -> Any:
    assert sock.poll(int(timeout_s * 1000)), "no message from the worker"
    return m.decode(sock.recv())


def _drain(sock: zmq.Socket, quiet_s: float = 0.5) -> list[m.KVEvents]:
    out = []
    while sock.poll(int(quiet_s * 1000)):
        msg = m.decode(sock.recv())
        assert isinstance(msg, m.KVEvents), msg
        out.append(msg)
    return out


def _generate(c: LocalCluster, prompt: list[int]) -> tuple[list[int], dict[str, int]]:
    before = dict(c.stats)
    (out,) = c.generate([prompt], GREEDY)
    assert out.error is None, out.error
    sent = {k: c.stats[k] - before.get(k, 0) for k in ("kv_send_bytes", "kv_send_frames")}
    sent.update({k: c.stats[k] - before.get(k, 0) for k in ("kv_recv_bytes", "kv_recv_frames")})
    return out.outputs[0].token_ids, sent


def test_second_handoff_sends_only_what_decode_lacks_and_events_flow(  # type: ignore[no-untyped-def]
    tiny_llama_path, reference
) -> None:
    a, b = _prompts()
    with LocalCluster(
        str(tiny_llama_path),
        transport="tcp",
        threads=1,
        prefill_args={"block_size": 4},
        decode_args={"block_size": D_BLOCK},
    ) as c:
        sub = _subscribe(c, "D0")
        (snapshot,) = _drain(sub)
        assert snapshot.cleared and snapshot.seq == 0 and snapshot.stored == []
        assert snapshot.worker_id == "D0" and snapshot.block_size == D_BLOCK

        got_a, first = _generate(c, a)
        assert got_a == reference[0]
        events = _drain(sub)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))  # no gaps
        stored = {h for e in events for h in e.stored}
        assert set(hash_full_blocks(a, D_BLOCK)) <= stored  # received KV became cached

        index = PrefixIndex()
        for e in [snapshot, *events]:
            index.apply(e)
        assert index.match(b, D_BLOCK, ["D0"]) == {"D0": SHARED}  # routing would see the hit

        got_b, second = _generate(c, b)
        assert got_b == reference[1]
        stats = c.worker_stats()
        assert stats["D0"]["kv_tokens_reused"] == SHARED
        assert stats["P0"]["kv_tokens_skipped"] == SHARED
        # b's prompt is 4 tokens longer than a's, yet far fewer bytes crossed: 3 blocks fewer
        assert second["kv_recv_bytes"] < first["kv_recv_bytes"] * 0.6, (first, second)
        assert second["kv_send_bytes"] < first["kv_send_bytes"] * 0.6, (first, second)
        assert second["kv_recv_frames"] <= first["kv_recv_frames"]
        assert stats["D0"]["kv_event_subscribers"] == 2  # the router core and us, not the cluster
        for e in _drain(sub):
            index.apply(e)
        assert not index.needs_resync("D0")
        sub.close(0)
        assert_cluster_idle(c)


def test_handoff_after_k_tokens_and_no_streaming_with_a_cached_prefix(  # type: ignore[no-untyped-def]
    tiny_llama_path,
) -> None:
    """P skips D's cached prefix on both the streaming and the send-after-prefill path, and
    with P running several decode steps before the hand-off."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_llama_path)).generate(_prompts(), params)]
    for stream_kv, handoff in ((False, 1), (True, 3)):
        with LocalCluster(
            str(tiny_llama_path),
            transport="inproc",
            stream_kv=stream_kv,
            handoff_tokens=handoff,
            prefill_args={"block_size": 16},
            decode_args={"block_size": D_BLOCK},
        ) as c:
            for prompt, expected in zip(_prompts(), want, strict=True):
                (out,) = c.generate([prompt], params)
                assert out.error is None and out.outputs[0].token_ids == expected
            stats = c.worker_stats()
            assert stats["D0"]["kv_tokens_reused"] == SHARED, (stream_kv, handoff)
            assert c.stats["retries"] == 0
            assert_cluster_idle(c)


def test_hello_again_resyncs_with_a_fresh_snapshot(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    a, _ = _prompts()
    with LocalCluster(
        str(tiny_llama_path), prefill=0, decode=0, colocated=1, transport="inproc"
    ) as c:
        sub = _subscribe(c, "C0")
        assert _drain(sub)[0].cleared
        (out,) = c.generate([a], GREEDY)
        assert out.error is None
        deadline = time.monotonic() + 10
        events: list[m.KVEvents] = []
        while not any(e.stored for e in events):
            assert time.monotonic() < deadline
            events += _drain(sub, 0.2)
        sub.send(m.encode(m.Hello("test-subscriber")))  # e.g. after the index saw a gap
        assert isinstance(_recv(sub), m.WorkerInfo)
        snap = _recv(sub)
        assert isinstance(snap, m.KVEvents) and snap.cleared and snap.seq == 0
        assert set(hash_full_blocks(a, 16)) <= set(snap.stored)  # default block size 16
        sub.close(0)
        assert_cluster_idle(c)


def _side_context(engine: Any) -> Any:
    from pdserve.workers.context import HandoffSettings, WorkerContext

    return WorkerContext("W", engine, HandoffSettings(b"\x00" * 8), lambda rid, msg: None)


def _side_recording_frames() -> tuple[Any, list[tuple[int, int, list[float]]]]:
    """A PrefillSide on a stub engine whose frames are recorded, not sent: (layer, start, rows)."""
    from types import SimpleNamespace

    from pdserve.transfer.api import LinkSetup
    from pdserve.transfer.fake import FakeNetwork
    from pdserve.workers.prefill import PrefillSide

    engine = SimpleNamespace(runner=SimpleNamespace(layer_hook=None))
    side = PrefillSide(_side_context(engine), FakeNetwork().sender(LinkSetup("W")))
    sent: list[tuple[int, int, list[float]]] = []

    def record(o: Any, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        sent.append((layer, start, k[:, 0, 0].tolist()))
        o.next_token[layer] = start + k.shape[0]

    side._send_frame = record  # type: ignore[method-assign,assignment]
    return side, sent


@pytest.mark.parametrize(
    ("have", "want"),
    [
        (16, [(0, 16, [3.0, 4.0, 5.0, 6.0]), (1, 16, [3.0, 4.0, 5.0, 6.0])]),  # span starts at it
        (18, [(0, 18, [5.0, 6.0]), (1, 18, [5.0, 6.0])]),  # inside: only rows from `have` on
        (20, []),  # the whole span is cached on D: nothing
    ],
)
def test_layer_hook_sends_only_rows_decode_lacks(have: int, want: list) -> None:  # type: ignore[type-arg]
    from pdserve.engine.model_runner import RowSpan
    from pdserve.workers.prefill import Outgoing

    side, sent = _side_recording_frames()
    o = Outgoing("r", "D0", None, GREEDY, 0.0, stage="streaming", next_token=[have, have])  # type: ignore[arg-type]
    side.out["r"] = o
    kv = torch.arange(10, dtype=torch.float32).view(10, 1, 1)  # row i holds i
    spans = [RowSpan("other", 0, 3, 0), RowSpan("r", 3, 4, 16)]  # r: positions 16..19, rows 3..6
    for layer in (0, 1):
        side.on_layer(layer, kv, kv, spans)
    assert sent == want
    assert o.next_token == [max(have, 20)] * 2


def test_decode_rejects_a_frame_before_its_cached_prefix() -> None:
    from types import SimpleNamespace

    from pdserve.transfer import wire
    from pdserve.transfer.api import LinkSetup
    from pdserve.transfer.fake import FakeNetwork
    from pdserve.workers.decode import DecodeSide, Incoming

    writes: list[int] = []
    engine = SimpleNamespace(
        write_kv=lambda slots, *a: writes.append(len(slots)),
        cache=SimpleNamespace(layer_group=[0, 0]),  # one KV group: both layers on table 0
    )
    side = DecodeSide(_side_context(engine), FakeNetwork().receiver(LinkSetup("W")))
    inc = Incoming(
        "r", [1] * 30, GREEDY, "P0", 30, b"c", 0.0, stage="receiving",
        slots=[torch.arange(30)], next_token=[24, 24], have_tokens=24,
    )  # fmt: skip
    fp = b"\x00" * wire.FINGERPRINT_BYTES

    def frame(start: int, n: int) -> wire.Frame:
        k = torch.zeros(n, 2, 8)
        return wire.decode_frame(
            wire.encode_frame("r", 0, start, [k], [k], "none", fp), fingerprint=fp
        )

    with pytest.raises(ValueError, match="cached here"):
        side._store(inc, frame(20, 10))
    assert writes == [] and inc.next_token == [24, 24]
    side._store(inc, frame(24, 6))
    assert writes == [6] and inc.next_token == [30, 24]


def test_large_event_batches_are_split_and_only_the_first_part_clears(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from pdserve.workers import worker as wmod

    sent: list[m.KVEvents] = []
    stub = SimpleNamespace(
        subscribers={b"a": 0},
        worker_id="W",
        engine=SimpleNamespace(cache=SimpleNamespace(block_size=4)),
        _send=lambda client, msg: sent.append(msg),
    )
    monkeypatch.setattr(wmod, "EVENT_CHUNK", 2)
    wmod.Worker._send_kv_events(stub, b"a", [b"1", b"2", b"3"], [b"4"], True)  # type: ignore[arg-type]
    assert [(e.seq, e.stored, e.removed, e.cleared) for e in sent] == [
        (0, [b"1", b"2"], [], True),
        (1, [b"3"], [], False),
        (2, [], [b"4"], False),
    ]
    index = PrefixIndex()
    for e in sent:
        index.apply(e)
    assert index.stats()["hashes"] == {"W": 3} and not index.needs_resync("W")
    sent.clear()
    # an empty snapshot is one message
    wmod.Worker._send_kv_events(stub, b"a", [], [], True)  # type: ignore[arg-type]
    assert [(e.seq, e.cleared) for e in sent] == [(3, True)]
