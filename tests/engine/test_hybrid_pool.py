"""Gemma 2 and Gemma 3 (sliding layers 0 and 2 beside global layers 1 and 3) and Qwen2 with
max_window_layers=1 (layer 0 global, layer 1 sliding), window 16, blocks of 8, with a KV pool
(FakeKVPool, chunks of 4): the engine keeps its two KV groups, each group puts its own layers under
its own namespace (the sliding group block by block, before the window frees them), a fresh engine
loads a prefix into both groups and answers as transformers and as an engine without a pool do, and
an engine keeping every layer in one group never reads a group's values (nor the other way
round)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest
import torch

import tiny_arch
from pdserve import LLM, SamplingParams
from pdserve.engine.block_pool import hash_full_blocks
from pdserve.engine.hybrid_kv import HybridKVCacheManager
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.pool_link import PoolLink
from pdserve.kvpool.api import BlockHash, FakeKVPool, PoolNamespace
from pdserve.workers import pool as worker_pool

WINDOW, BS, C = 16, 8, 4
NEW_TOKENS = 30
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
# variant -> (config overrides, its sliding layers, its global layers)
MODELS = {
    "gemma2": ({}, "0,2", "1,3"),
    "gemma3": ({}, "0,2", "1,3"),
    "qwen2.5": ({"use_sliding_window": True, "max_window_layers": 1}, "1", "0"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def mixed(request, tmp_path_factory, default_tokenizer):  # type: ignore[no-untyped-def]
    """The model, a 130-token prompt and transformers' greedy tokens for it, a prompt sharing
    its first 40 tokens with transformers' last-position logprobs (a random tiny model's
    greedy tokens barely notice wrong KV; its logprobs do), and the model's layers of each
    kind."""
    overrides, sliding, full = MODELS[request.param]
    folder = tmp_path_factory.mktemp(f"{request.param}-pool")
    model = tiny_arch.save(
        folder, request.param, default_tokenizer, sliding_window=WINDOW, **overrides
    )
    long, tail = tiny_arch.prompts((130, 70), seed=11)
    other = long[:40] + tail
    want = tiny_arch.hf_greedy(model, long, NEW_TOKENS)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([other])).logits[0, -1], -1)
    return folder, long, want, other, ref, (sliding, full)


def _llm(folder: object, **kw: int) -> LLM:
    return LLM(str(folder), block_size=BS, num_blocks=64, **kw)  # type: ignore[arg-type]


def _namespace(llm: LLM) -> PoolNamespace:
    return replace(worker_pool.namespace(llm.engine), chunk_blocks=C)


def _link(llm: LLM) -> PoolLink:
    assert llm.engine.pool_link is not None
    return llm.engine.pool_link


def _one_group(llm: LLM) -> LLM:
    """The engine with one block table for every layer (`build_kv(groups=False)`): one KV group
    for a mixed model, its values under the pool's every-layer namespace."""
    eng = llm.engine
    eng._build_kv(groups=False)
    eng.scheduler.kv = eng.kv_manager
    eng.runner.cache = eng.cache
    return llm


def _idle(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished_requests() and not eng._live
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
    assert not eng.kv_manager.pinned()


def _held(kv: KVCacheManager, rid: str) -> int:
    null = kv.null_block.block_id if kv.null_block is not None else -1
    return sum(b != null for b in kv.get_block_ids(rid))


@dataclass
class LosesLayers(FakeKVPool):
    """Promises what it holds, but `get` under the namespace of layers `lose` returns nothing
    (evicted between lookup and get, or late)."""

    lose: str = ""

    def get(
        self, hashes: Sequence[BlockHash], deadline: float, start: int = 0
    ) -> list[torch.Tensor]:
        if self.namespace.layers == self.lose:
            return []
        return super().get(hashes, deadline, start)


def test_with_a_pool_both_groups_stay_and_each_puts_its_layers(mixed) -> None:  # type: ignore[no-untyped-def]
    """130 prompt tokens in steps of 32 and 30 more: the sliding group holds at most its
    window's and one step's blocks throughout; every one of the 19 full blocks goes into the
    pool in each group (the global group in chunks of 4, the sliding one a block at a time,
    none lost to the window), under the groups' namespaces only."""
    folder, long, want, _, _, (sliding_layers, global_layers) = mixed
    a = _llm(folder, max_num_batched_tokens=32, max_num_seqs=2)
    pool = FakeKVPool(_namespace(a))
    a.engine.attach_pool(pool)
    kv = a.engine.kv_manager
    assert isinstance(kv, HybridKVCacheManager)
    kinds = {str(i): g for i, g in enumerate(a.engine.cache.layer_group)}
    assert {kinds[i] for i in sliding_layers.split(",")} == {1}
    assert {kinds[i] for i in global_layers.split(",")} == {0}
    full, sliding = (g.pool for g in _link(a).groups)
    assert (full.namespace.layers, sliding.namespace.layers) == (global_layers, sliding_layers)
    assert (full.namespace.chunk_blocks, sliding.namespace.chunk_blocks) == (C, 1)
    eng = a.engine
    rid = eng.add_request(long, GREEDY)
    out: list[int] = []
    most = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o.outputs[0].token_ids
        for r in eng.scheduler.running:
            decoded = r.num_computed_tokens > r.num_prompt_tokens
            bound = -(-WINDOW // BS) + 1 if decoded else -(-(WINDOW - 1 + 32) // BS) + 1
            most = max(most, _held(kv.sliding, rid))
            assert _held(kv.sliding, rid) <= bound, r.num_computed_tokens
    assert out == want and most <= 7
    assert isinstance(full, FakeKVPool) and isinstance(sliding, FakeKVPool)
    assert (full.puts, full.put_blocks) == (5, 19)
    assert (sliding.puts, sliding.put_blocks) == (19, 19)
    s = eng.stats()
    assert s["kv_pool_put_blocks"] == 38 and s["kv_pool_put_gaps"] == 0
    chain = hash_full_blocks(long, BS)
    assert pool.lookup(chain) == 0  # nothing under the every-layer namespace
    assert full.lookup(chain) == sliding.lookup(chain) == 16
    _idle(a)


def test_a_fresh_engine_loads_both_groups_and_answers_exactly(mixed) -> None:  # type: ignore[no-untyped-def]
    """b loads the 130-token prompt's 16 full blocks but the last token's (the global group all
    of them, the sliding group the window's last two) and computes 2 tokens of it; c loads the
    first chunk of a prompt sharing 40 tokens (blocks 0-3: the chunk over block 4 ends in
    blocks c does not share) and its logprobs equal transformers'. Greedy tokens equal those
    of an engine without a pool."""
    folder, long, want, other, ref, _ = mixed
    plain, a, b, c = (_llm(folder) for _ in range(4))
    pool = FakeKVPool(_namespace(a))
    for llm in (a, b, c):
        llm.engine.attach_pool(pool)
    alone = plain.generate([long], GREEDY)[0].outputs[0].token_ids
    assert alone == want
    assert a.generate([long], GREEDY)[0].outputs[0].token_ids == want

    before = b.engine.stats()["prefill_tokens"]
    (out,) = b.generate([long], GREEDY)
    assert out.outputs[0].token_ids == alone
    s = b.engine.stats()
    assert s["prefill_tokens"] - before == 2
    assert s["kv_pool_hit_tokens"] == s["kv_pool_loaded_tokens"] == 128
    assert s["kv_pool_recomputed_tokens"] == 0
    assert out.metrics is not None and out.metrics.num_cached_tokens == 128

    (out,) = c.generate([other], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    assert out.metrics is not None and out.metrics.num_cached_tokens == 32
    assert c.engine.stats()["kv_pool_loaded_tokens"] == 32
    got = out.outputs[0].logprobs[0]  # type: ignore[index]
    assert got and all(abs(lp - ref[t].item()) < 1e-4 for t, lp in got.items())
    for llm in (plain, a, b, c):
        _idle(llm)


def test_a_sliding_group_that_does_not_deliver_is_recomputed(mixed) -> None:  # type: ignore[no-untyped-def]
    """The pool promises 128 tokens but returns none of the sliding group's blocks: the global
    blocks alone make no hit (the window before its end is missing), so b computes the whole
    prompt, counts the 128 tokens recomputed, and answers exactly."""
    folder, long, want, _, _, (sliding_layers, _) = mixed
    a, b = _llm(folder), _llm(folder)
    ns = _namespace(a)
    pool = FakeKVPool(ns)
    a.engine.attach_pool(pool)
    b.engine.attach_pool(LosesLayers(ns, blocks=pool.blocks, lose=sliding_layers))
    a.generate([long], GREEDY)
    (out,) = b.generate([long], GREEDY)
    assert out.outputs[0].token_ids == want
    s = b.engine.stats()
    assert s["kv_pool_hit_tokens"] == 128 and s["kv_pool_loaded_tokens"] == 0
    assert s["kv_pool_recomputed_tokens"] == 128 and s["prefill_tokens"] == 130
    for llm in (a, b):
        _idle(llm)


@pytest.mark.parametrize("writer_groups", [True, False])
def test_one_group_and_grouped_engines_never_read_each_other(mixed, writer_groups) -> None:  # type: ignore[no-untyped-def]
    """One store, one model: an engine keeping every layer in one table and a grouped one put
    under different namespaces, so neither finds the other's values; each answers exactly."""
    folder, long, want, *_ = mixed
    grouped, single = _llm(folder), _one_group(_llm(folder))
    assert isinstance(single.engine.kv_manager, KVCacheManager)
    ns = _namespace(grouped)
    assert ns == _namespace(single)  # the same pool namespace: the groups' namespaces differ
    store = FakeKVPool(ns)
    for llm in (grouped, single):
        llm.engine.attach_pool(FakeKVPool(ns, blocks=store.blocks))
    digests = {_link(llm).namespace.digest() for llm in (grouped, single)}
    assert len(digests) == 2 and ns.digest() in digests
    writer, reader = (grouped, single) if writer_groups else (single, grouped)
    assert writer.generate([long], GREEDY)[0].outputs[0].token_ids == want
    assert len(store.blocks) > 0
    assert reader.generate([long], GREEDY)[0].outputs[0].token_ids == want
    assert reader.engine.stats()["kv_pool_hit_tokens"] == 0
    for llm in (grouped, single):
        _idle(llm)


def test_a_pool_of_some_layers_is_refused(mixed) -> None:  # type: ignore[no-untyped-def]
    folder, *_ = mixed
    a = _llm(folder)
    ns = _namespace(a)
    with pytest.raises(ValueError, match="every layer"):
        a.engine.attach_pool(FakeKVPool(ns.for_layers([1], C)))
    with pytest.raises(ValueError, match="not a KV group"):
        FakeKVPool(ns).for_namespace(replace(ns.for_layers([0], 1), codec="int8"))
