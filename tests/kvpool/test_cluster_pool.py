"""The KV pool's users in a real cluster (inproc workers sharing one FakeKVPool, tiny model):
a prefix computed on one P is loaded by another, a request whose D goes down resumes from the
pool, and the router shows the pool in timelines, counters and /admin/kvpool."""

from __future__ import annotations

from typing import Any

import pytest

from factories import assert_cluster_idle, eventually
from pdserve import LLM, SamplingParams
from pdserve.cluster import LocalCluster
from pdserve.kvpool.api import FakeKVPool, KVPoolConfig, PoolNamespace
from pdserve.router import timeline as tl

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
SYSTEM = list(range(100, 164))  # 64 tokens: 4 full blocks of 16
BS = 16
ONE: dict[str, Any] = {"colocated": 1, "prefill": 0, "decode": 0}  # one colocated worker


class SharedPool:
    """A pool factory: every worker gets the same in-process fake (inproc workers only)."""

    def __init__(self) -> None:
        self.pool: FakeKVPool | None = None

    def __call__(self, config: KVPoolConfig, ns: PoolNamespace) -> FakeKVPool:
        if self.pool is None:
            self.pool = FakeKVPool(ns)
        assert self.pool.namespace == ns
        return self.pool


def _cluster(path: object, shared: SharedPool | None, **kw: Any) -> LocalCluster:
    kw.setdefault("pool_factory", shared)
    return LocalCluster(str(path), transport="inproc", threads=1, **kw)


def _labels(out: Any, ev: tl.Ev) -> list[tuple[str, str]]:
    return [(e.split(": ", 1)[1], w) for e, w, _ in out.timeline if tl.kind_of(e) == ev]


@pytest.fixture(scope="module")
def ref(tiny_llama_path):  # type: ignore[no-untyped-def]
    return LLM(str(tiny_llama_path), block_size=BS)


def test_second_prefill_worker_loads_the_first_ones_prefix(tiny_llama_path, ref) -> None:  # type: ignore[no-untyped-def]
    a, b = [*SYSTEM, 7, 8, 9, 10, 11], [*SYSTEM, 20, 21, 22]
    want = [o.outputs[0].token_ids for o in ref.generate([a, b], PARAMS)]
    with _cluster(tiny_llama_path, SharedPool(), prefill=2, decode=1) as c:
        (out_a,) = c.generate([a], PARAMS)
        (out_b,) = c.generate([b], PARAMS)  # round robin: the other P
        assert [out_a.outputs[0].token_ids, out_b.outputs[0].token_ids] == want
        firsts = [w for o in (out_a, out_b) for e, w, _ in o.timeline if e == tl.Ev.FIRST_TOKEN]
        assert {firsts[0], firsts[2]} == {"P0", "P1"}  # two different P's prefilled
        stats = c.worker_stats()
        p_b = firsts[2]
        # the second P computed only the 3-token tail after the 64 pooled tokens
        assert stats[p_b]["prefill_tokens"] == len(b) - 64
        assert stats[p_b]["kv_pool_loaded_tokens"] == 64
        assert _labels(out_b, tl.Ev.POOL_LOAD) == [("64 of 64 tokens", p_b)]
        assert c.stats["pool_loaded_tokens"] == 64
        assert c.core is not None
        report = c.core.kvpool()
        assert set(report["workers"]) == {"P0", "P1", "D0"}
        # the index was right (no pool eviction): nothing corrected
        assert report["index_corrections"] == 0 and "prior_bytes_per_s" in report["bandwidth"]
        # the router polls each worker's stats every second
        eventually(lambda: c.core.kvpool()["workers"][p_b]["use"].get("loaded_tokens") == 64)  # type: ignore[union-attr]
        assert_cluster_idle(c)


def test_a_request_whose_decode_worker_goes_down_resumes_from_the_pool(
    tiny_llama_path, ref
) -> None:  # type: ignore[no-untyped-def]
    prompt = [*SYSTEM, 5, 6, 7]
    want = ref.generate([prompt], LONG)[0].outputs[0].token_ids
    shared = SharedPool()
    with _cluster(tiny_llama_path, shared, prefill=1, decode=2) as c:
        assert c.core is not None and c._loop is not None
        for d in ("D0", "D1"):
            c.set_fault(d, "slow", count=-1, delay_s=0.03)
        (rid,), fut = c.submit([prompt], LONG)
        flight = eventually(lambda: c.core.flights.get(rid), what="the flight")  # type: ignore[union-attr]
        eventually(lambda: len(flight.sent) >= 40, what="40 tokens streamed")
        pair = c.pair_of(rid)
        assert pair is not None and pair[1] is not None
        victim = next(w for w in c.core.workers if w.worker_id == pair[1])
        c._loop.call_soon_threadsafe(c.core.worker_down, victim, "test")
        (out,) = fut.result(timeout=60)
        assert out.error is None, out.error
        assert out.outputs[0].token_ids == want  # nothing lost, nothing repeated
        survivor = "D1" if pair[1] == "D0" else "D0"
        ((label, worker),) = _labels(out, tl.Ev.RECOVERED_FROM_POOL)
        assert worker == survivor  # the other D read the pool itself: no P, no transfer
        assert _labels(out, tl.Ev.ROUTE)[-1] == ("pool_resume", survivor)
        assert c.stats["recovered_from_pool"] == 1
        loaded = c.stats["recovery_pool_loaded_tokens"]
        recomputed = c.stats["recovery_recomputed_tokens"]
        # the survivor caches nothing of this request: the pool gave the prompt blocks P had
        # written and the generated ones the dead D had, so only the tail after the last full
        # block was computed
        assert loaded >= len(prompt) + 40 - 2 * BS and recomputed < BS
        assert label.startswith(f"loaded {loaded} on {survivor}, recomputed {recomputed} of ")
        assert c.worker_stats()[survivor]["kv_pool_loaded_tokens"] == loaded
        for d in ("D0", "D1"):
            c.set_fault(d, "none")
        assert_cluster_idle(c)


def test_a_pool_eviction_the_index_did_not_see_is_corrected_by_the_next_lookup(
    tiny_llama_path, ref
) -> None:  # type: ignore[no-untyped-def]
    a, b = [*SYSTEM, 7, 8, 9], [*SYSTEM, 20, 21]
    shared = SharedPool()
    with _cluster(tiny_llama_path, shared, prefill=2, decode=1) as c:
        assert c.core is not None
        c.generate([a], PARAMS)  # P0 computes SYSTEM and puts its 4 blocks
        index = c.core.routing.pools
        eventually(lambda: max(index.stats().values(), default=0) >= 4, what="the index")
        assert shared.pool is not None
        shared.pool.close()  # the pool evicts everything (Redis allkeys-lru, a tier's cap)
        (out,) = c.generate([b], PARAMS)  # round robin: P1, whose lookup finds nothing
        assert _labels(out, tl.Ev.POOL_LOOKUP)[0][0] == "0 tokens"
        assert c.stats["pool_index_corrections"] == 1
        assert c.core.kvpool()["index_corrections"] == 1
        assert_cluster_idle(c)


def test_without_a_pool_nothing_changes(tiny_llama_path, ref) -> None:  # type: ignore[no-untyped-def]
    a = [*SYSTEM, 7, 8, 9]
    want = ref.generate([a], PARAMS)[0].outputs[0].token_ids
    with _cluster(tiny_llama_path, None, prefill=1, decode=1) as c:
        (out,) = c.generate([a], PARAMS)
        assert out.outputs[0].token_ids == want
        assert not _labels(out, tl.Ev.POOL_LOOKUP)
        assert c.core is not None and c.core.kvpool()["workers"] == {}
        assert all("kv_pool" not in s for s in c.worker_stats().values())
        assert_cluster_idle(c)


def test_two_clusters_sharing_a_pool_reuse_each_others_prefixes(tiny_llama_path, ref) -> None:  # type: ignore[no-untyped-def]
    a, b = [*SYSTEM, 1, 2, 3], [*SYSTEM, 4, 5]
    want = [o.outputs[0].token_ids for o in ref.generate([a, b], PARAMS)]
    shared = SharedPool()
    with (
        _cluster(tiny_llama_path, shared, name="A", **ONE) as one,
        _cluster(tiny_llama_path, shared, name="B", **ONE) as two,
    ):
        (out_a,) = one.generate([a], PARAMS)
        (out_b,) = two.generate([b], PARAMS)
        assert [out_a.outputs[0].token_ids, out_b.outputs[0].token_ids] == want
        assert _labels(out_a, tl.Ev.POOL_LOOKUP) == [("0 tokens", "AC0")]
        assert _labels(out_b, tl.Ev.POOL_LOAD) == [("64 of 64 tokens", "BC0")]
        assert two.worker_stats()["BC0"]["prefill_tokens"] == len(b) - 64
        for c in (one, two):
            assert_cluster_idle(c)


def test_clusters_of_different_models_never_share(tiny_llama_path, tiny_qwen2_path) -> None:  # type: ignore[no-untyped-def]
    store: dict = {}

    def factory(config: KVPoolConfig, ns: PoolNamespace) -> FakeKVPool:
        return FakeKVPool(ns, blocks=store)  # one store: only the namespace keeps them apart

    prompt = [*SYSTEM, 1, 2, 3]
    want = LLM(str(tiny_qwen2_path), block_size=BS).generate([prompt], PARAMS)
    with (
        _cluster(tiny_llama_path, None, name="L", **ONE, pool_factory=factory) as llama,
        _cluster(tiny_qwen2_path, None, name="Q", **ONE, pool_factory=factory) as qwen,
    ):
        llama.generate([prompt], PARAMS)
        assert len(store) >= 4
        (out,) = qwen.generate([prompt], PARAMS)
        assert out.outputs[0].token_ids == want[0].outputs[0].token_ids
        assert _labels(out, tl.Ev.POOL_LOOKUP) == [("0 tokens", "QC0")]
        for c in (llama, qwen):
            assert_cluster_idle(c)


# ---- worker processes sharing a real Redis (the redis_server fixture of tests/kvpool) ---------
def _tcp(path: object, redis_url: str, **kw: Any) -> LocalCluster:
    pool = {"kv_pool_redis": redis_url}
    return LocalCluster(str(path), transport="tcp", threads=1, kv_pool=pool, **kw)


def _redis_puts(c: LocalCluster, worker_id: str) -> int:
    return int(c.worker_stats()[worker_id]["kv_pool"]["tiers"]["redis"]["puts"])


def test_two_deployments_share_prefixes_through_redis_and_other_models_never(
    tiny_llama_path, tiny_qwen2_path, ref, redis_url
) -> None:  # type: ignore[no-untyped-def]
    a, b = [*SYSTEM, 1, 2, 3], [*SYSTEM, 4, 5]
    want = [o.outputs[0].token_ids for o in ref.generate([a, b], PARAMS)]
    with (
        _tcp(tiny_llama_path, redis_url, **ONE) as one,
        _tcp(tiny_llama_path, redis_url, **ONE) as two,
        _tcp(tiny_qwen2_path, redis_url, **ONE) as other,
    ):
        (out_a,) = one.generate([a], PARAMS)
        eventually(lambda: _redis_puts(one, "C0") >= 4, what="the prefix written to Redis")
        (out_b,) = two.generate([b], PARAMS)
        assert [out_a.outputs[0].token_ids, out_b.outputs[0].token_ids] == want
        assert _labels(out_b, tl.Ev.POOL_LOAD) == [("64 of 64 tokens", "C0")]
        assert two.worker_stats()["C0"]["prefill_tokens"] == len(b) - 64
        (out_q,) = other.generate([a], PARAMS)  # another model, the same Redis
        assert _labels(out_q, tl.Ev.POOL_LOOKUP) == [("0 tokens", "C0")]
        for c in (one, two, other):
            assert_cluster_idle(c)


def test_a_killed_decode_workers_request_resumes_from_redis(
    tiny_llama_path, ref, redis_url
) -> None:  # type: ignore[no-untyped-def]
    prompt = [*SYSTEM, 5, 6, 7]
    want = ref.generate([prompt], LONG)[0].outputs[0].token_ids
    with _tcp(tiny_llama_path, redis_url, prefill=1, decode=2, deadline_s=2.0) as c:
        assert c.core is not None
        for d in ("D0", "D1"):
            c.set_fault(d, "slow", count=-1, delay_s=0.03)
        (rid,), fut = c.submit([prompt], LONG)
        flight = eventually(lambda: c.core.flights.get(rid), what="the flight")  # type: ignore[union-attr]
        eventually(lambda: len(flight.sent) >= 40, what="40 tokens streamed")
        pair = c.pair_of(rid)
        assert pair is not None and pair[1] is not None
        c.kill(pair[1])
        (out,) = fut.result(timeout=60)
        assert out.error is None, out.error
        assert out.outputs[0].token_ids == want  # nothing lost, nothing repeated
        survivor = "D1" if pair[1] == "D0" else "D0"
        ((label, worker),) = _labels(out, tl.Ev.RECOVERED_FROM_POOL)
        assert worker == survivor and c.stats["recovered_from_pool"] == 1  # D read Redis
        loaded = c.stats["recovery_pool_loaded_tokens"]
        assert label.startswith(f"loaded {loaded} on {survivor}, ")
        # D wrote its blocks as they filled (asynchronously: the last ones may not have
        # landed before the kill); most of the generated context came back from Redis
        assert c.stats["recovery_pool_loaded_tokens"] >= 16
        assert c.stats["recovery_recomputed_tokens"] < 40
        for d in ("D0", "D1"):
            if d != pair[1]:
                c.set_fault(d, "none")
        assert_cluster_idle(c)
