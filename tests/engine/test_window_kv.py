"""A sliding window on every layer (a tiny Mistral, window 16, blocks of 8): the KV blocks that
leave the window go back to the pool as prompt chunks and decodes move it, the block table keeps
its positions (the null block stands in), admission counts only the window's blocks, and the
prefix cache still gives correct output. Greedy tokens equal transformers' float32 throughout.
"""

from __future__ import annotations

import pytest

import tiny_arch
from factories import assert_engine_idle, assert_no_leaks, make_kv, make_request
from pdserve import LLM, SamplingParams
from pdserve.engine.block_pool import hash_full_blocks
from pdserve.engine.kv_cache_manager import KVCacheManager

WINDOW, BS = 16, 8
DECODE_BOUND = -(-WINDOW // BS) + 1  # blocks one decoding sequence may hold: 3
NEW_TOKENS = 60
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)  # greedy: a prefix of 60


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, default_tokenizer):  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("mistral-w16")
    model = tiny_arch.save(folder, "mistral-window", default_tokenizer, sliding_window=WINDOW)
    prompts = tiny_arch.prompts((100, 130, 9), seed=11)
    want = [tiny_arch.hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    # shares the first 40 tokens (5 blocks) of prompts[0]
    other = prompts[0][:40] + prompts[1][:70]
    want.append(tiny_arch.hf_greedy(model, other, 8))
    return folder, [*prompts, other], want


def _real_blocks(kv: KVCacheManager, rid: str) -> int:
    assert kv.null_block is not None
    return sum(b != kv.null_block.block_id for b in kv.get_block_ids(rid))


@pytest.mark.parametrize("attention", ["paged", "gather"])
def test_blocks_stay_in_the_window_and_greedy_equals_transformers(mistral, attention) -> None:  # type: ignore[no-untyped-def]
    """Three prompts (100, 130 and 9 tokens) in chunks of at most 32 tokens, 60 tokens each:
    every step, each request holds at most the blocks of its window and that step's tokens
    (3 while it decodes), the whole cache no more than their sum."""
    folder, prompts, want = mistral
    llm = LLM(
        str(folder), block_size=BS, num_blocks=64, attention=attention, max_num_batched_tokens=32
    )
    eng, kv = llm.engine, llm.engine.kv_manager
    assert kv.window == WINDOW
    rids = [eng.add_request(p, GREEDY) for p in prompts[:3]]
    tokens: dict[str, list[int]] = {}
    decoding_steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens[o.request_id] = o.outputs[0].token_ids
        running = eng.scheduler.running
        held = {r.request_id: _real_blocks(kv, r.request_id) for r in running}
        for r in running:
            decoded = r.num_computed_tokens > r.num_prompt_tokens  # the step was a decode
            bound = DECODE_BOUND if decoded else -(-(WINDOW - 1 + 32) // BS) + 1
            assert held[r.request_id] <= bound, (r.request_id, r.num_computed_tokens, held)
            decoding_steps += decoded
        assert kv.num_blocks - kv.num_free_blocks == sum(held.values())
    assert decoding_steps > 2 * NEW_TOKENS  # the bound was checked while they decoded
    assert [tokens[r] for r in rids] == want[:3]
    assert_engine_idle(llm)


def test_a_request_longer_than_the_cache_fits_its_window(mistral) -> None:  # type: ignore[no-untyped-def]
    """7 usable blocks (56 slots) serve a 130-token prompt and 60 more tokens: the window's
    blocks are all it ever holds, so admission takes it and the output is still exact."""
    folder, prompts, want = mistral
    llm = LLM(str(folder), block_size=BS, num_blocks=8, max_num_batched_tokens=32)
    kv = llm.engine.kv_manager
    assert kv.num_blocks == 7 and kv.blocks_needed(130 + NEW_TOKENS) > kv.num_blocks
    assert [o.outputs[0].token_ids for o in llm.generate([prompts[1]], GREEDY)] == [want[1]]
    assert_engine_idle(llm)


@pytest.mark.parametrize("num_blocks", [64, 12])
def test_the_same_prompt_again_hits_the_cache_and_stays_exact(mistral, num_blocks) -> None:  # type: ignore[no-untyped-def]
    """The prompt's blocks freed by the window keep valid KV until evicted: a second run of the
    same prompt finds its window's blocks (right to left) and computes from there. With 12
    blocks the first ones were evicted meanwhile, and the hit is the window's blocks alone."""
    folder, prompts, want = mistral
    llm = LLM(str(folder), block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=32)
    first = llm.generate([prompts[0]], SHORT)[0]
    pool, hashes = llm.engine.kv_manager.pool, hash_full_blocks(prompts[0], BS)
    assert (pool.get_cached_block(hashes[0]) is None) == (num_blocks == 12)
    second = llm.generate([prompts[0]], SHORT)[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == want[0][:20]
    assert first.metrics is not None and second.metrics is not None
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == (len(prompts[0]) - 1) // BS * BS
    # a prompt that shares only the first 40 tokens: a hit there (while they are cached)
    got = llm.generate([prompts[3]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert got[0].outputs[0].token_ids == want[3]
    assert got[0].metrics is not None
    assert got[0].metrics.num_cached_tokens == (40 if num_blocks == 64 else 0)
    assert_engine_idle(llm)


def test_n_choices_fork_the_windowed_kv(mistral) -> None:  # type: ignore[no-untyped-def]
    """n = 3 greedy choices of the 130-token prompt share its window's full blocks (and its
    null entries) and copy its last partial block: each gives transformers' tokens."""
    folder, prompts, want = mistral
    llm = LLM(str(folder), block_size=BS, num_blocks=32, max_num_batched_tokens=32)
    params = SamplingParams(n=3, max_tokens=20, temperature=0, ignore_eos=True)
    (out,) = llm.generate([prompts[1]], params)
    assert [c.token_ids for c in out.outputs] == [want[1][:20]] * 3
    assert llm.engine.counters.forked_choices == 2
    assert_engine_idle(llm)


# ---- the KV manager alone ----------------------------------------------------------------------
def test_sliding_frees_leading_blocks_and_keeps_positions() -> None:
    kv = make_kv(num_blocks=16, block_size=4, window=6)
    null = kv.null_block.block_id  # type: ignore[union-attr]
    assert kv.num_blocks == 15 and kv.num_free_blocks == 15
    req = make_request("a", prompt_len=20, max_tokens=8)
    ids = kv.allocate_slots(req, 20)
    assert ids is not None and len(ids) == 5 and null not in ids
    req.num_computed_tokens = 20
    # position 20 sees keys 15..20: blocks 0..2 (tokens 0..11) are out of the window
    ids = kv.allocate_slots(req, 1)
    assert ids is not None and ids[:3] == [null] * 3 and null not in ids[3:] and len(ids) == 6
    assert kv.num_free_blocks == 15 - 3
    assert kv.pool.num_cached_blocks == 5  # the freed blocks keep their (valid) KV's hashes
    kv.free("a")
    assert_no_leaks(kv)


def test_window_lookup_finds_the_window_blocks_after_eviction() -> None:
    kv = make_kv(num_blocks=16, block_size=4, window=6)
    prompt = list(range(100, 124))  # 6 full blocks
    a = make_request("a", prompt=prompt)
    kv.allocate_slots(a, 24)
    kv.free("a")
    hashes = hash_full_blocks(prompt, 4)
    c = make_request("c", prompt=prompt[:8] + [7] * 16)  # blocks 0-1 cached, not its window
    assert kv.find_cached_prefix(c).num_tokens == 8  # a run from the first block: a hit
    kv.free("c")  # (its hashes)
    for h in hashes[:3]:  # evict the first three blocks' content
        kv.pool._evict(kv.pool._cached[h])
    b = make_request("b", prompt=prompt)
    hit = kv.find_cached_prefix(b)
    # at most 23 tokens: 5 blocks; the query at 20 needs keys 15..19, blocks 3 and 4
    assert hit.num_tokens == 20 and hit.blocks[:3] == [None] * 3
    assert all(blk is not None for blk in hit.blocks[3:])
    ids = kv.allocate_slots(b, 4, hit)
    assert ids is not None and ids[:3] == [kv.null_block.block_id] * 3  # type: ignore[union-attr]
    kv.free("b")
    assert_no_leaks(kv)


def test_reserve_holds_the_window_and_registers_only_complete_blocks() -> None:
    """A decode worker's reservation for 32 KV tokens (+ the one it computes): blocks from the
    window of position 32 only (tokens 27..32); block 6 (tokens 24..27) holds only token 27, so
    it is never registered in the prefix cache; block 7 is, once admitted."""
    kv = make_kv(num_blocks=16, block_size=4, window=6)
    req = make_request("d", prompt_len=33, max_tokens=4)
    got = kv.reserve_with_prefix(req, 33, 31, complete_from=27)
    assert got is not None
    ids, cached = got
    assert cached == 0 and len(ids) == 9 and ids[:6] == [kv.null_block.block_id] * 6  # type: ignore[union-attr]
    assert kv.num_free_blocks == 15 - 3
    req.num_computed_tokens = 32
    kv.allocate_slots(req, 1)  # admitted: registers its full blocks but the incomplete one
    assert [kv.pool.blocks[i].block_hash is not None for i in ids[6:]] == [False, True, False]
    kv.free("d")
    assert_no_leaks(kv)


def test_peak_blocks_counts_the_window_and_one_chunk() -> None:
    kv = make_kv(num_blocks=16, block_size=8, window=16)
    assert kv.peak_blocks(190, 1) == 3 and kv.peak_blocks(190, 32) == 7
    assert kv.peak_blocks(10, 32) == 2  # a short request: its own blocks
    assert make_kv(num_blocks=16, block_size=8).peak_blocks(190, 32) == 24


def test_start_up_log_says_what_the_windows_keep(caplog) -> None:  # type: ignore[no-untyped-def]
    from pdserve.engine.kv_cache import log_window_layout
    from pdserve.engine.models.arch import ModelArch

    base = dict(architecture="gemma3", vocab_size=10, hidden_size=8, intermediate_size=8,
                num_layers=4, num_heads=1, num_kv_heads=1, head_dim=8)  # fmt: skip
    mixed = ModelArch(**base, sliding_window=16, layer_types=("sliding", "full") * 2)  # type: ignore[arg-type]
    every = ModelArch(**base, sliding_window=16, layer_types=("sliding",) * 4)  # type: ignore[arg-type]
    with caplog.at_level("INFO", logger="pdserve.engine.kv_cache"):
        log_window_layout(mixed)
        log_window_layout(every)
        log_window_layout(ModelArch(**base))  # type: ignore[arg-type]
    mixed_line, every_line = (r.getMessage() for r in caplog.records)
    assert "2 of 4 layers" in mixed_line and "window layers keep full KV" in mixed_line
    assert mixed.uniform_window is None and every.uniform_window == 16
    assert "every layer" in every_line and "freed" in every_line
