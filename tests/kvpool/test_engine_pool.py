"""The engine with a KV pool (FakeKVPool, tiny models): the same greedy tokens with and without
it, a fresh engine computes only what the pool does not hold (in whole chunks), a pool that
delivers less than it promised is recomputed (counted), and different models never share
entries. Chunk sizes are set here: a tiny model's blocks are so small that --kv-pool-chunk-mb
would give the maximum."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.kvpool.api import BlockHash, FakeKVPool, PoolNamespace
from pdserve.workers import pool as worker_pool


def assert_engine_idle(llm: LLM) -> None:
    """Nothing alive, every KV block free (tests/conftest.py's check; this folder's conftest
    shadows that module name)."""
    eng = llm.engine
    assert not eng.has_unfinished_requests() and not eng._live
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
    assert not eng.kv_manager.pinned()


PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
BS = 8


def namespace(engine: LLMEngine, chunk_blocks: int = 4) -> PoolNamespace:
    return replace(worker_pool.namespace(engine), chunk_blocks=chunk_blocks)


def _llm(path: object) -> LLM:
    return LLM(str(path), block_size=BS, num_blocks=128)


def _prompt(n: int, seed: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49000, (n,), generator=g).tolist()


def _prefilled(llm: LLM) -> int:
    return int(llm.engine.stats()["prefill_tokens"])


@dataclass
class ShortPool(FakeKVPool):
    """Promises every block it holds but delivers at most `deliver` (a deadline or a corrupt
    entry cutting the load short)."""

    deliver: int = 0

    def get(
        self, hashes: Sequence[BlockHash], deadline: float, start: int = 0
    ) -> list[torch.Tensor]:
        return super().get(hashes, deadline, start)[: self.deliver]


@pytest.mark.parametrize(("c", "pooled"), [(4, 64), (3, 48)])
def test_fresh_engine_loads_the_prefix_and_computes_only_the_tail(
    tiny_llama_path, c, pooled
) -> None:  # type: ignore[no-untyped-def]
    """The 64-token system prompt is blocks 0-7. At C=4 they are two whole chunks of a's; at
    C=3 a stored [6-8] with its own block 8, so b finds [0-2], [3-5] and computes the rest."""
    ref, a, b = _llm(tiny_llama_path), _llm(tiny_llama_path), _llm(tiny_llama_path)
    pool = FakeKVPool(namespace(a.engine, c))
    a.engine.attach_pool(pool)
    b.engine.attach_pool(pool)
    system = _prompt(64)  # 8 full blocks
    first, second = system + _prompt(5, 7), system + _prompt(9, 8)
    want = [ref.generate([p], PARAMS)[0].outputs[0].token_ids for p in (first, second)]

    got_a = a.generate([first], PARAMS)[0]
    assert got_a.outputs[0].token_ids == want[0]
    # every full block a computed went in (prompt and generated: 78 tokens, 9 blocks), as
    # chunks filled and the tail when a finished
    assert pool.put_blocks == 9 and pool.puts == -(-9 // c)
    assert a.engine.stats()["kv_pool_put_blocks"] == 9

    before = _prefilled(b)
    out = b.generate([second], PARAMS)[0]
    assert out.outputs[0].token_ids == want[1]  # loaded KV gives the same greedy tokens
    # b computed only the tail after the pooled tokens (+ one decode token per step)
    assert _prefilled(b) - before == len(second) - pooled
    s = b.engine.stats()
    assert s["kv_pool_loaded_tokens"] == pooled and s["kv_pool_recomputed_tokens"] == 0
    assert out.metrics is not None and out.metrics.num_cached_tokens == pooled
    for llm in (ref, a, b):
        assert_engine_idle(llm)


def test_the_first_output_reports_what_the_pool_loaded(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    a, b = _llm(tiny_llama_path), _llm(tiny_llama_path)
    pool = FakeKVPool(namespace(a.engine))
    a.engine.attach_pool(pool)
    b.engine.attach_pool(pool)
    prompt = _prompt(40)
    a.generate([prompt], PARAMS)
    eng = b.engine
    eng.add_request(prompt, PARAMS, "r")
    reports = []
    while eng.has_unfinished_requests():
        reports += [o.kv_pool for o in eng.step()]
    assert reports[0] is not None and all(r is None for r in reports[1:])
    assert reports[0]["hit_tokens"] == 32 and reports[0]["loaded_tokens"] == 32
    assert_engine_idle(b)


@pytest.mark.parametrize("deliver", [0, 2])
def test_a_pool_that_delivers_less_than_promised_is_recomputed(tiny_llama_path, deliver) -> None:  # type: ignore[no-untyped-def]
    ref, a, b = _llm(tiny_llama_path), _llm(tiny_llama_path), _llm(tiny_llama_path)
    ns = namespace(a.engine, chunk_blocks=2)  # a stores [0-1], [2-3], [4-5] and [6]
    full = FakeKVPool(ns)
    a.engine.attach_pool(full)
    short = ShortPool(ns, blocks=full.blocks, deliver=deliver)
    b.engine.attach_pool(short)
    prompt = _prompt(50)
    want = ref.generate([prompt], PARAMS)[0].outputs[0].token_ids
    a.generate([prompt], PARAMS)
    before = _prefilled(b)
    assert b.generate([prompt], PARAMS)[0].outputs[0].token_ids == want
    s = b.engine.stats()
    assert s["kv_pool_hit_tokens"] == 48  # 6 full blocks promised
    assert s["kv_pool_loaded_tokens"] == deliver * BS
    assert s["kv_pool_recomputed_tokens"] == 48 - deliver * BS  # counted
    assert _prefilled(b) - before == len(prompt) - deliver * BS
    for llm in (ref, a, b):
        assert_engine_idle(llm)


def test_a_block_of_the_wrong_shape_is_never_used(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    ref, b = _llm(tiny_llama_path), _llm(tiny_llama_path)
    ns = namespace(b.engine)
    pool = FakeKVPool(ns)
    b.engine.attach_pool(pool)
    prompt = _prompt(30)
    from pdserve.engine.block_pool import hash_full_blocks

    for h in hash_full_blocks(prompt, BS):
        pool.blocks[ns.key(h)] = [torch.zeros(1, 2, 3)]  # a bad entry under the right key
    want = ref.generate([prompt], PARAMS)[0].outputs[0].token_ids
    assert b.generate([prompt], PARAMS)[0].outputs[0].token_ids == want
    s = b.engine.stats()
    assert s["kv_pool_loaded_tokens"] == 0 and s["kv_pool_recomputed_tokens"] == 24
    assert s["kv_pool_errors"] == 1
    assert_engine_idle(b)


def test_different_models_never_share_entries(tiny_llama_path, tiny_qwen2_path) -> None:  # type: ignore[no-untyped-def]
    llama, qwen = _llm(tiny_llama_path), _llm(tiny_qwen2_path)
    ns_l, ns_q = namespace(llama.engine), namespace(qwen.engine)
    assert ns_l.layout == ns_q.layout  # same KV shape: only the model fingerprint differs
    assert ns_l.digest() != ns_q.digest()
    shared = FakeKVPool(ns_l)
    llama.engine.attach_pool(shared)
    qwen.engine.attach_pool(FakeKVPool(ns_q, blocks=shared.blocks))  # one store, two models
    prompt = _prompt(40)
    llama.generate([prompt], PARAMS)
    assert len(shared.blocks) > 0
    qwen.generate([prompt], PARAMS)
    assert qwen.engine.stats()["kv_pool_hit_tokens"] == 0
    for llm in (llama, qwen):
        assert_engine_idle(llm)


def test_an_aborted_request_puts_its_open_chunk(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    """C=4, a 50-token prompt (6 full blocks): the prefill step puts [0-3] as it fills; [4-5]
    stays open until the request ends - here by an abort - and then goes as a partial chunk."""
    from pdserve.engine.block_pool import hash_full_blocks

    a = _llm(tiny_llama_path)
    pool = FakeKVPool(namespace(a.engine, chunk_blocks=4))
    a.engine.attach_pool(pool)
    prompt = _prompt(50)
    eng = a.engine
    eng.add_request(prompt, PARAMS, "r")
    eng.step()  # the whole prompt: blocks 0-5 registered
    assert (pool.puts, pool.put_blocks) == (1, 4)
    eng.abort_request("r")
    assert (pool.puts, pool.put_blocks) == (2, 6)
    assert pool.lookup(hash_full_blocks(prompt, BS)) == 6
    assert eng.stats()["kv_pool_put_blocks"] == 6
    assert_engine_idle(a)


@pytest.fixture(scope="module")
def mistral_w16(tmp_path_factory, default_tokenizer):  # type: ignore[no-untyped-def]
    """A tiny Mistral with a window of 16, a 130-token prompt, one sharing its first 40
    tokens; transformers' greedy tokens of the first and last-position logprobs of the other."""
    import tiny_arch

    folder = tmp_path_factory.mktemp("mistral-w16")
    model = tiny_arch.save(folder, "mistral-window", default_tokenizer, sliding_window=16)
    prompt = _prompt(130)
    other = prompt[:40] + _prompt(20, 9)
    want = tiny_arch.hf_greedy(model, prompt, PARAMS.max_tokens)
    with torch.no_grad():  # a random tiny model's greedy tokens barely notice wrong KV
        ref = torch.log_softmax(model(torch.tensor([other])).logits[0, -1], -1)
    return folder, prompt, other, want, ref


@pytest.mark.parametrize("c", [4, 8])
def test_a_windowed_model_pools_each_block_s_own_kv(mistral_w16, c) -> None:  # type: ignore[no-untyped-def]
    """Mistral, window 16, 4 usable blocks, a block a step: a's blocks leave the window and
    are taken again soon after. Chunks of 4 blocks fill before that; chunks of 8 do not, and
    the pool keeps only blocks that still held their KV when their chunk filled. b loads a's
    prompt from the pool, then runs a prompt sharing its first 40 tokens, whose first query
    reads blocks 3-4 of what b holds: a's own KV, or computed by b, never another's."""
    folder, prompt, other, want, ref = mistral_w16
    a = LLM(str(folder), block_size=BS, num_blocks=5, max_num_batched_tokens=BS)
    b = LLM(str(folder), block_size=BS, num_blocks=64)
    pool = FakeKVPool(namespace(a.engine, c))
    a.engine.attach_pool(pool)
    b.engine.attach_pool(pool)
    assert a.generate([prompt], PARAMS)[0].outputs[0].token_ids == want
    assert [o.outputs[0].token_ids for o in b.generate([prompt], PARAMS)] == [want]
    (out,) = b.generate([other], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    assert out.metrics is not None and out.metrics.num_cached_tokens == 40
    got = out.outputs[0].logprobs[0]  # type: ignore[index]
    assert got and all(abs(lp - ref[t].item()) < 1e-4 for t, lp in got.items())
    assert (a.engine.stats()["kv_pool_put_gaps"] > 0) == (c == 8)
    s = b.engine.stats()  # chunks of 8: those from the first block lost their first blocks
    assert (s["kv_pool_loaded_tokens"] > 0) == (c == 4) and s["kv_pool_recomputed_tokens"] == 0
    assert_engine_idle(a)
    assert_engine_idle(b)
