"""Two engines in one process hand a request over by copying KV token ranges: the engine half of
disaggregation, without workers or a transport."""

from __future__ import annotations

import pytest
import torch

from factories import assert_engine_idle, handoff
from pdserve import LLM, SamplingParams


@pytest.mark.parametrize(("p_block", "d_block", "k"), [(4, 4, 1), (4, 16, 1), (16, 4, 3)])
def test_handoff_equals_single_engine(tiny_llama_path, p_block, d_block, k) -> None:  # type: ignore[no-untyped-def]
    path = str(tiny_llama_path)
    ref = LLM(path, block_size=8, num_blocks=256)
    p = LLM(path, block_size=p_block, num_blocks=256)
    d = LLM(path, block_size=d_block, num_blocks=256)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(2)
    for n in (3, 17, 50):
        prompt = torch.randint(3, 49000, (n,), generator=g).tolist()
        want = ref.generate([prompt], params)[0].outputs[0].token_ids
        assert handoff(p, d, prompt, params, k) == want
    for llm in (ref, p, d):
        assert_engine_idle(llm)
        assert not llm.engine.scheduler.held and not llm.engine._reserved


def test_reserve_refuses_and_cancel_frees(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    d = LLM(str(tiny_llama_path), block_size=4, num_blocks=8)
    params = SamplingParams(max_tokens=2, temperature=0)
    assert d.engine.reserve_kv([5] * 20, params, "a", 20) is not None
    assert d.engine.reserve_kv([5] * 20, params, "b", 20) is None
    with pytest.raises(ValueError, match="in use"):
        d.engine.reserve_kv([5] * 4, params, "a", 4)
    assert d.engine.cancel_reserved("a") and not d.engine.cancel_reserved("a")
    assert_engine_idle(d)


def test_seed_penalties_and_bias_give_the_colocated_output_across_thehandoff(
    tiny_llama_path,  # type: ignore[no-untyped-def]
) -> None:
    """P samples the first token(s), D the rest: a seeded, penalized, biased request gives the
    tokens one engine gives (the draw is keyed on (seed, position), penalties on the history)."""
    path = str(tiny_llama_path)
    ref = LLM(path, block_size=8, num_blocks=256)
    p = LLM(path, block_size=4, num_blocks=256)
    d = LLM(path, block_size=4, num_blocks=256)
    prompt = torch.randint(3, 49000, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    cases = [
        SamplingParams(max_tokens=10, temperature=1.0, seed=42, ignore_eos=True),
        SamplingParams(
            max_tokens=10,
            temperature=0,
            ignore_eos=True,
            frequency_penalty=2.0,
            presence_penalty=1.0,
            repetition_penalty=1.5,
            logit_bias={prompt[0]: 100.0},
        ),
        SamplingParams(
            max_tokens=10, temperature=0.8, top_k=50, seed=7, ignore_eos=True, frequency_penalty=1
        ),
    ]
    for params in cases:
        want = ref.generate([prompt], params)[0].outputs[0].token_ids
        for k in (1, 3):
            assert handoff(p, d, prompt, params, k) == want
    for llm in (ref, p, d):
        assert_engine_idle(llm)


def test_n_choices_across_the_handoff_fork_on_d(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    """P prefills once and samples every choice's first token; one KV copy; D forks the
    choices from it: the outputs are the colocated n-choice outputs."""
    path = str(tiny_llama_path)
    ref = LLM(path, block_size=8, num_blocks=256)
    p = LLM(path, block_size=4, num_blocks=256)
    d = LLM(path, block_size=4, num_blocks=256)
    prompt = list(range(200, 213))
    params = SamplingParams(max_tokens=7, temperature=0.9, seed=3, ignore_eos=True, n=3)
    want = [c.token_ids for c in ref.generate([prompt], params)[0].outputs]
    pe, de = p.engine, d.engine
    rid = pe.add_request(
        prompt, SamplingParams(**{**params.__dict__, "max_tokens": 1}), "r", hold_kv=True
    )
    while pe.has_unfinished_requests():
        pe.step()
    held = pe.held_request(rid)
    assert held is not None and len(held.fork_tokens) == 2
    n_kv = held.num_computed_tokens
    blocks = de.reserve_kv(prompt, params, rid, n_kv)
    assert blocks is not None
    src = pe.kv_slots(pe.kv_manager.get_block_ids(rid), 0, n_kv)
    dst = de.kv_slots(blocks, 0, n_kv)
    for layer in range(pe.arch.num_layers):
        de.write_kv(dst, layer, *pe.read_kv(src, layer))
    assert pe.release_kv(rid)
    de.admit_prefilled(rid, held.output_token_ids, n_kv, held.fork_tokens)
    got: dict[int, list[int]] = {}
    while de.has_unfinished_requests():
        for o in de.step():
            if o.finished:
                got[o.outputs[0].index] = o.outputs[0].token_ids
    assert [got[i] for i in range(3)] == want
    assert de.stats()["forked_choices"] == 2
    for llm in (ref, p, d):
        assert_engine_idle(llm)


def test_n_choices_that_all_stop_on_their_first_token_end_on_d(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tiny_llama_path)
    p = LLM(path, block_size=4, num_blocks=64)
    d = LLM(path, block_size=4, num_blocks=64)
    prompt = list(range(300, 310))
    first = p.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    stop = first.outputs[0].token_ids  # greedy: every choice's first token
    params = SamplingParams(max_tokens=5, temperature=0, n=3, stop_token_ids=stop)
    pe, de = p.engine, d.engine
    local = SamplingParams(**{**params.__dict__, "max_tokens": 1})
    pe.add_request(prompt, local, "r", hold_kv=True)
    while pe.has_unfinished_requests():
        pe.step()
    held = pe.held_request("r")
    assert held is not None and held.fork_tokens == stop * 2
    blocks = de.reserve_kv(prompt, params, "r", len(prompt))
    assert blocks is not None
    assert pe.release_kv("r")
    de.admit_prefilled("r", held.output_token_ids, len(prompt), held.fork_tokens)
    outs = de.step()  # nothing to compute: every choice ended on admission
    assert sorted(o.outputs[0].index for o in outs) == [0, 1, 2]
    assert all(o.finished and o.outputs[0].finish_reason == "stop" for o in outs)
    assert [o.new_token_ids for o in outs if o.outputs[0].index > 0] == [stop, stop]
    for llm in (p, d):
        assert_engine_idle(llm)
    assert not de._children
