"""1P1D over real workers: token-exact parity, transports, hand-off knobs, injected faults."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from factories import assert_cluster_idle, eventually
from pdserve import LLM, SamplingParams
from pdserve.cluster import LocalCluster

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _prompts() -> list[str | list[int]]:
    g = torch.Generator().manual_seed(21)
    long = torch.randint(3, 49000, (70,), generator=g).tolist()  # many blocks on both sides
    return ["Hi", "The quick brown fox jumps over the lazy dog", long, [17]]


@pytest.fixture(scope="module")
def reference(tiny_llama_path) -> list[list[int]]:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_llama_path), block_size=8)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]


def _ids(outs) -> list[list[int]]:  # type: ignore[no-untyped-def]
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tcp_cluster(tiny_llama_path):  # type: ignore[no-untyped-def]
    with LocalCluster(
        str(tiny_llama_path),
        transport="tcp",
        deadline_s=1.0,
        lease_s=2.0,
        prefill_args={"block_size": 4},
        decode_args={"block_size": 16},
    ) as c:
        yield c


@pytest.mark.parametrize("transport", ["inproc", "ipc", "shm"])
def test_parity_over_transport(tiny_llama_path, reference, transport) -> None:  # type: ignore[no-untyped-def]
    with LocalCluster(
        str(tiny_llama_path),
        transport=transport,
        prefill_args={"block_size": 16},
        decode_args={"block_size": 4},
    ) as c:
        assert _ids(c.generate(_prompts(), GREEDY)) == reference
        assert c.stats["kv_send_frames"] > 0 and c.stats["retries"] == 0
        assert_cluster_idle(c)


def test_parity_over_tcp_with_different_block_sizes(tcp_cluster, reference) -> None:  # type: ignore[no-untyped-def]
    outs = tcp_cluster.generate(_prompts(), GREEDY)
    assert _ids(outs) == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    stats = tcp_cluster.worker_stats()
    assert stats["P0"]["handoffs_acked"] >= 4 and stats["D0"]["handoffs_received"] >= 4
    assert_cluster_idle(tcp_cluster)


def test_colocated_worker_matches(tiny_llama_path, reference) -> None:  # type: ignore[no-untyped-def]
    with LocalCluster(
        str(tiny_llama_path), prefill=0, decode=0, colocated=1, transport="inproc"
    ) as c:
        assert _ids(c.generate(_prompts(), GREEDY)) == reference
        assert_cluster_idle(c)


def test_handoff_after_k_tokens(tiny_llama_path, reference) -> None:  # type: ignore[no-untyped-def]
    with LocalCluster(str(tiny_llama_path), transport="inproc", handoff_tokens=4) as c:
        outs = c.generate(_prompts(), GREEDY)
        assert _ids(outs) == reference
        assert_cluster_idle(c)


def test_step_logs_say_what_each_worker_computed(tcp_cluster) -> None:  # type: ignore[no-untyped-def]
    """P's log holds the prompt's chunk, D's the decode steps, in order, each with its time."""
    since = time.monotonic()
    prompt = list(range(100, 140))  # 40 tokens: one chunk on P
    (out,) = tcp_cluster.generate([prompt], GREEDY)
    assert out.error is None
    logs = tcp_cluster.step_logs(since)
    p, d = (logs[w.worker_id] for w in tcp_cluster.workers)
    assert sum(n for s in p for n, _ in s.chunks) == 40 and all(s.decodes == 0 for s in p)
    # D decodes the other 11 tokens one step each, past the prompt and P's first token
    assert [(s.decodes, s.chunks) for s in d] == [(1, ())] * 11
    assert [s.context for s in d] == list(range(41, 52))  # position 40 attends to 41 tokens
    assert all(s.start >= since and s.seconds > 0 for s in p + d)
    assert all(a.start + a.seconds <= b.start for a, b in itertools.pairwise(d))
    assert tcp_cluster.step_logs(time.monotonic()) == {w.worker_id: [] for w in tcp_cluster.workers}


def test_request_finishing_on_prefill_releases_decode_reservation(tcp_cluster) -> None:  # type: ignore[no-untyped-def]
    out = tcp_cluster.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0))[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 1
    assert out.outputs[0].finish_reason == "length"
    assert_cluster_idle(tcp_cluster)


@pytest.mark.parametrize("mode", ["corrupt", "drop"])
def test_bad_frame_is_detected_and_retried_once(tcp_cluster, reference, mode) -> None:  # type: ignore[no-untyped-def]
    before = tcp_cluster.stats["retries"]
    tcp_cluster.set_fault("P0", mode, count=1)
    t0 = time.monotonic()
    outs = tcp_cluster.generate(_prompts()[2:3], GREEDY)
    assert _ids(outs) == reference[2:3]  # the retry computed it again, correctly
    assert tcp_cluster.stats["retries"] == before + 1  # counted, not silent
    assert time.monotonic() - t0 < 10  # detected by checksum or by the 1 s deadline
    stats = tcp_cluster.worker_stats()
    assert stats["P0"]["faults_injected"] >= 1 and stats["D0"]["transfer_failures"] >= 1
    assert_cluster_idle(tcp_cluster)


def test_delayed_frame_within_deadline_needs_no_retry(tcp_cluster, reference) -> None:  # type: ignore[no-untyped-def]
    before = tcp_cluster.stats["retries"]
    tcp_cluster.set_fault("P0", "delay", count=3, delay_s=0.3)
    assert _ids(tcp_cluster.generate(_prompts()[1:2], GREEDY)) == reference[1:2]
    assert tcp_cluster.stats["retries"] == before
    assert_cluster_idle(tcp_cluster)


def test_persistent_link_failure_retries_once_then_recomputes_on_decode(  # type: ignore[no-untyped-def]
    tcp_cluster, reference
) -> None:
    before = dict(tcp_cluster.stats)
    tcp_cluster.set_fault("P0", "corrupt", count=-1)
    try:
        t0 = time.monotonic()
        outs = tcp_cluster.generate(_prompts()[1:2], GREEDY)
        assert _ids(outs) == reference[1:2]  # D computed the KV itself: same tokens
        assert time.monotonic() - t0 < 10
        assert tcp_cluster.stats["retries"] == before.get("retries", 0) + 1
        assert tcp_cluster.stats["recomputes"] == before.get("recomputes", 0) + 1
        events = [e for e, _, _ in outs[0].timeline or []]
        assert "recompute" in events and any("checksum" in e for e in events)  # visible
    finally:
        tcp_cluster.set_fault("P0", "none")
    assert_cluster_idle(tcp_cluster)


def test_smollm2_1p1d_equals_llm(smollm2) -> None:  # type: ignore[no-untyped-def]
    prompts = ["The capital of Germany is", "def fibonacci(n):", "Water boils at"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in smollm2.generate(prompts, params)]
    with LocalCluster(None, transport="tcp") as c:
        assert _ids(c.generate(prompts, params)) == want
        assert_cluster_idle(c)


def test_shm_ring_full_sends_inline_and_counts_it(tiny_llama_path, reference) -> None:  # type: ignore[no-untyped-def]
    # A 0 MiB ring holds nothing: every frame must go inline over the socket, visibly.
    with LocalCluster(str(tiny_llama_path), transport="shm", shm_mb=0) as c:
        assert _ids(c.generate(_prompts(), GREEDY)) == reference
        stats = c.worker_stats()
        assert stats["P0"]["shm_inline_frames"] == c.stats["kv_send_frames"] > 0
        assert_cluster_idle(c)


def test_bad_input_gets_clear_errors_and_the_workers_keep_serving(  # type: ignore[no-untyped-def]
    tiny_llama_path, reference
) -> None:
    import zmq

    from pdserve.workers import messages as m

    with LocalCluster(str(tiny_llama_path), transport="inproc") as c:
        p0 = c.workers[0]
        assert p0.sock is not None
        p0.sock.send(b"\x93garbage")  # not a message at all
        reply = m.decode(p0.sock.recv())
        assert isinstance(reply, m.RequestFailed) and "undecodable" in reply.reason
        p0.sock.send(m.encode(m.Generate("x.1", [1, 2], {"max_tokens": 2, "bogus": 1})))
        reply = m.decode(p0.sock.recv())
        assert isinstance(reply, m.RequestFailed) and "unknown sampling" in reply.reason
        # a KV frame from nowhere is dropped and counted, never trusted
        d0 = next(w for w in c.workers if w.role == "decode")
        assert d0.info is not None
        rogue = c.ctx.socket(zmq.DEALER)
        rogue.connect(d0.info.kv_endpoint)
        rogue.send_multipart([b"F", b"PDKV" + b"\x00" * 60, b"payload"])
        rogue.close(0)
        (too_long,) = c.generate([[5] * 5000], GREEDY)
        assert too_long.outputs[0].finish_reason == "error" and "shorten" in (too_long.error or "")
        assert _ids(c.generate(_prompts(), GREEDY)) == reference
        assert c.worker_stats()["D0"]["bad_frames"] >= 1
        assert_cluster_idle(c)


def test_lost_ack_is_reclaimed_by_the_lease_without_failing_the_request(  # type: ignore[no-untyped-def]
    tcp_cluster, reference
) -> None:
    before = tcp_cluster.worker_stats()["P0"].get("lease_reclaims", 0)
    tcp_cluster.set_fault("D0", "drop_ack", count=1)
    assert _ids(tcp_cluster.generate(_prompts()[:1], GREEDY)) == reference[:1]
    eventually(  # the lease is 2 s in this cluster
        lambda: tcp_cluster.worker_stats()["P0"].get("lease_reclaims", 0) != before,
        10,
        "P to reclaim the unacknowledged KV",
        interval_s=0.2,
    )
    assert_cluster_idle(tcp_cluster)


def test_decode_worker_that_can_never_reserve_fails_fast(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    # D's cache can never hold this request: D refuses at once instead of waiting for memory,
    # P learns it over the KV link, the requester gets the reason; both ends clean.
    with LocalCluster(
        str(tiny_llama_path),
        transport="inproc",
        deadline_s=1.0,
        decode_args={"num_blocks": 4, "block_size": 4},
    ) as c:
        t0 = time.monotonic()
        (big,) = c.generate([[7] * 60], GREEDY)
        assert big.outputs[0].finish_reason == "error" and time.monotonic() - t0 < 5
        assert "more KV blocks than the cache holds" in (big.error or "")
        assert c.stats["retries"] == 0  # a permanent refusal is not retried
        assert_cluster_idle(c)
