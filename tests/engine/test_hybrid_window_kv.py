"""Gemma 2 and Gemma 3 (sliding layers beside global ones, window 16, blocks of 8) with a KV group
per kind of layer (engine/hybrid_kv.py): the sliding layers hold only their window's blocks as
prompts and answers grow, the global layers every block; a request longer than the shared
layout could hold fits the same memory; prefix hits, n choices and speculation stay exact.
Greedy tokens equal transformers' float32 throughout."""

from __future__ import annotations

import pytest

import tiny_arch
from factories import assert_engine_idle
from pdserve import LLM, SamplingParams
from pdserve.engine.hybrid_kv import HybridKVCacheManager
from pdserve.engine.kv_cache_manager import KVCacheManager

WINDOW, BS = 16, 8
NEW_TOKENS = 30
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory, default_tokenizer):  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp(f"{request.param}-w16")
    model = tiny_arch.save(folder, request.param, default_tokenizer, sliding_window=WINDOW)
    prompts = tiny_arch.prompts((100, 130, 9), seed=11)
    other = prompts[0][:40] + prompts[1][:70]  # shares 5 blocks with prompts[0]
    prompts.append(other)
    want = [tiny_arch.hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    return folder, prompts, want


def _groups(llm: LLM) -> HybridKVCacheManager:
    kv = llm.engine.kv_manager
    assert isinstance(kv, HybridKVCacheManager)
    return kv


def _held(kv: KVCacheManager, rid: str) -> int:
    null = kv.null_block.block_id if kv.null_block is not None else -1
    return sum(b != null for b in kv.get_block_ids(rid))


@pytest.mark.parametrize("attention", ["paged", "gather"])
def test_sliding_blocks_stay_in_the_window_and_greedy_equals_transformers(gemma, attention) -> None:  # type: ignore[no-untyped-def]
    """Three prompts in chunks of at most 32 tokens, 30 tokens each: every step each request
    holds at most its window's and that step's sliding blocks (3 while it decodes) and every
    global block of its tokens."""
    folder, prompts, want = gemma
    llm = LLM(
        str(folder), block_size=BS, num_blocks=64, attention=attention, max_num_batched_tokens=32,
        max_num_seqs=4,
    )  # fmt: skip
    eng, kv = llm.engine, _groups(llm)
    assert kv.sliding.num_blocks < 64 < kv.full.num_blocks  # the split gave the global layers more
    rids = [eng.add_request(p, GREEDY) for p in prompts[:3]]
    tokens: dict[str, list[int]] = {}
    decoding = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens[o.request_id] = o.outputs[0].token_ids
        for r in eng.scheduler.running:
            decoded = r.num_computed_tokens > r.num_prompt_tokens
            bound = -(-WINDOW // BS) + 1 if decoded else -(-(WINDOW - 1 + 32) // BS) + 1
            assert _held(kv.sliding, r.request_id) <= bound, (r.request_id, r.num_computed_tokens)
            assert _held(kv.full, r.request_id) == -(-r.num_computed_tokens // BS) or not decoded
            decoding += decoded
        sliding_used = kv.sliding.num_blocks - kv.sliding.num_free_blocks
        assert sliding_used == sum(_held(kv.sliding, r.request_id) for r in eng.scheduler.running)
    assert decoding > NEW_TOKENS
    assert [tokens[r] for r in rids] == want[:3]
    assert_engine_idle(llm)


def test_a_long_request_holds_a_window_of_sliding_blocks(gemma) -> None:  # type: ignore[no-untyped-def]
    """A 130-token prompt and 30 more tokens: the sliding group ends holding 3 blocks (the
    window's), the global group all 20 (the shared table held 20 blocks of every layer)."""
    folder, prompts, want = gemma
    llm = LLM(str(folder), block_size=BS, num_blocks=64, max_num_seqs=2)
    eng, kv = llm.engine, _groups(llm)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    rid = eng.add_request(prompts[1], params)
    most = {"sliding": 0, "full": 0}
    out: list[int] = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o.outputs[0].token_ids
        if eng.scheduler.running:
            most["sliding"] = max(most["sliding"], _held(kv.sliding, rid))
            most["full"] = max(most["full"], _held(kv.full, rid))
            last = (_held(kv.sliding, rid), _held(kv.full, rid))
    assert out == want[1]
    # 130 prompt tokens in one step: all 17 sliding blocks while it ran, then the window's
    assert most == {"sliding": 17, "full": 20}
    assert last == (3, 20)  # 159 tokens of KV at the last decode
    assert_engine_idle(llm)


def test_a_request_longer_than_the_shared_layout_fits_the_same_memory(gemma) -> None:  # type: ignore[no-untyped-def]
    """16 blocks of every layer's memory: the shared table held 128 tokens, too few for 130
    prompt tokens and 30 more. Split (one sequence, steps of 32), the sliding layers take 10
    blocks and the global layers 22 (176 tokens): the request runs, exactly."""
    folder, prompts, want = gemma
    llm = LLM(str(folder), block_size=BS, num_blocks=16, max_num_seqs=1, max_num_batched_tokens=32)
    kv, cache = _groups(llm), llm.engine.cache
    assert (kv.full.num_blocks, kv.sliding.num_blocks + 1) == (22, 10)  # + the null block
    assert kv.blocks_needed(130 + NEW_TOKENS - 1) > 16
    assert cache.nbytes <= 16 * cache.layout.block_nbytes(BS)  # no more memory than before
    assert [o.outputs[0].token_ids for o in llm.generate([prompts[1]], GREEDY)] == [want[1]]
    assert_engine_idle(llm)


def test_a_prefix_hit_reads_both_groups(gemma) -> None:  # type: ignore[no-untyped-def]
    """A prompt sharing 40 tokens with an earlier one finds them cached (5 blocks: the global
    group's all, the sliding group's window before token 40) and answers exactly."""
    folder, prompts, want = gemma
    llm = LLM(str(folder), block_size=BS, num_blocks=64, max_num_batched_tokens=32)
    assert llm.generate([prompts[0]], GREEDY)[0].outputs[0].token_ids == want[0]
    (out,) = llm.generate([prompts[3]], GREEDY)
    assert out.metrics.num_cached_tokens == 40 and out.outputs[0].token_ids == want[3]
    assert_engine_idle(llm)


def test_n_choices_and_speculation_on_both_groups(gemma) -> None:  # type: ignore[no-untyped-def]
    """n=3 choices forked from one prefill (the partial block copied in each group) equal
    separate requests; ngram speculation (rejected drafts trimmed in both groups) equals plain
    greedy decoding."""
    folder, prompts, _ = gemma
    llm = LLM(str(folder), block_size=BS, num_blocks=64)
    base = dict(max_tokens=8, temperature=1.0, ignore_eos=True)
    (out,) = llm.generate([prompts[1]], SamplingParams(n=3, seed=5, **base))  # type: ignore[arg-type]
    assert llm.engine.stats()["forked_choices"] == 2
    for i, choice in enumerate(out.outputs):
        alone = llm.generate([prompts[1]], SamplingParams(seed=5 + i, **base))  # type: ignore[arg-type]
        assert choice.token_ids == alone[0].outputs[0].token_ids
    assert_engine_idle(llm)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    llm = LLM(str(folder), block_size=BS, num_blocks=64, speculative_config=spec)
    repeat = prompts[0][:20] * 5  # n-grams for the drafter to find
    plain = LLM(str(folder), block_size=BS, num_blocks=64).generate([repeat], GREEDY)
    assert llm.generate([repeat], GREEDY)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.engine.stats()["spec_draft_tokens"] > 0
    assert_engine_idle(llm)
