"""n choices from one prompt: one prefill, the choices forked from its KV (shared full blocks,
the partial one copied on write), each its own sampler state and seed."""

from __future__ import annotations

import pytest
import torch

from factories import assert_engine_idle
from pdserve import LLM, SamplingParams
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), SamplingParams())


def test_kv_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = _req("p", 10)
    assert kv.allocate_slots(parent, 10) is not None
    pb = kv.get_block_ids("p")
    assert len(pb) == 3
    src, dst = kv.fork("p", "c", 10) or (None, None)
    cb = kv.get_block_ids("c")
    assert cb[:2] == pb[:2] and src == pb[2] and dst == cb[2] and dst not in pb
    assert kv.num_free_blocks == 8 - 4
    kv.free("p")  # the shared blocks stay held by the child
    assert kv.num_free_blocks == 8 - 3
    kv.free("c")
    assert kv.num_free_blocks == 8
    # a prompt of whole blocks: nothing to copy
    assert kv.allocate_slots(_req("q", 8), 8) is not None
    assert kv.fork("q", "d", 8) is None and kv.get_block_ids("d") == kv.get_block_ids("q")
    with pytest.raises(ValueError, match="already holds"):
        kv.fork("q", "d", 8)
    kv.free("q")
    kv.free("d")
    assert kv.num_free_blocks == 8


def test_kv_fork_without_a_free_block_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert kv.allocate_slots(_req("p", 6), 6) is not None
    with pytest.raises(MemoryError):
        kv.fork("p", "c", 6)
    assert not kv.has_request("c") and kv.num_free_blocks == 0


@pytest.mark.parametrize("prompt_len", [7, 8])  # a partial last block, and whole blocks only
def test_n_choices_equal_separate_requests_with_seed_plus_i(tiny_llama_path, prompt_len) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_llama_path), block_size=4, num_blocks=64)
    prompt = torch.randint(3, 49000, (prompt_len,), generator=torch.Generator().manual_seed(3))
    ids = prompt.tolist()
    base = dict(max_tokens=6, temperature=1.0, ignore_eos=True, logprobs=1)
    out = llm.generate([ids], SamplingParams(n=3, seed=11, **base))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    stats = llm.engine.stats()
    assert stats["forked_choices"] == 2 and stats["fork_recomputes"] == 0
    for i, choice in enumerate(out.outputs):
        alone = llm.generate([ids], SamplingParams(seed=11 + i, **base))[0].outputs[0]
        assert choice.token_ids == alone.token_ids and choice.text == alone.text
        assert len(choice.logprobs or ()) == 6
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds differ, so do choices
    assert_engine_idle(llm)


def test_n_choices_prefill_once(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_llama_path), block_size=4, num_blocks=64)
    ids = list(range(100, 130))
    llm.generate([ids], SamplingParams(n=4, max_tokens=3, temperature=0, ignore_eos=True))
    s = llm.engine.stats()
    # 30 prompt tokens once; each of 4 choices decodes 2 tokens after its first
    assert s["prefill_tokens"] == 30 and s["decode_tokens"] == 4 * 2
    assert_engine_idle(llm)


def test_choice_that_stops_at_once_and_abort_free_everything(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_llama_path), block_size=4, num_blocks=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(n=3, max_tokens=1, temperature=0))[0]
    assert [len(c.token_ids) for c in out.outputs] == [1, 1, 1]
    assert all(c.finish_reason == "length" for c in out.outputs)
    eng = llm.engine
    eng.add_request([5, 6, 7, 8, 9], SamplingParams(n=4, max_tokens=50, seed=1), "r")
    eng.step()
    eng.step()
    assert eng.scheduler.num_running == 4
    eng.abort_request("r")
    assert_engine_idle(llm)
    assert not eng._children
