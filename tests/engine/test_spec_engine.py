"""Speculation through the whole engine on a tiny random model: greedy output identical with
and without drafts, the KV of rejected drafts rolled back and never in the prefix cache, stop
strings and max_tokens cut as without, n > 1, logprobs, grammar requests left undrafted, and
the P -> D hand-off with speculation on D."""

from __future__ import annotations

import pytest
import torch

from factories import assert_engine_idle, assert_no_leaks, handoff
from pdserve import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# Token prompts: a repeating one (drafts found from the start), a random one (drafts only once
# the output repeats: greedy decoding of a random model falls into loops).
_g = torch.Generator().manual_seed(7)
RANDOM = torch.randint(3, 49000, (23,), generator=_g).tolist()
REPEAT = (torch.randint(3, 49000, (6,), generator=_g).tolist() * 5)[:27]
PROMPTS = [REPEAT, RANDOM]


@pytest.fixture(scope="module")
def pair(tiny_llama_path) -> tuple[LLM, LLM]:  # type: ignore[no-untyped-def]
    args = {"block_size": 4, "num_blocks": 256, "max_model_len": 256}
    return LLM(str(tiny_llama_path), **args), LLM(
        str(tiny_llama_path), speculative_config=SPEC, **args
    )


def _ids(outs) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [c.token_ids for o in outs for c in o.outputs]


def _idle(*llms: LLM) -> None:
    for llm in llms:
        assert_engine_idle(llm)
        assert_no_leaks(llm.engine.scheduler)


def test_greedy_output_is_identical_and_drafts_are_accepted(pair) -> None:  # type: ignore[no-untyped-def]
    plain, spec = pair
    params = SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)
    before = spec.engine.stats()
    want = _ids(plain.generate(PROMPTS, params))
    got = _ids(spec.generate(PROMPTS, params))
    assert got == want
    after = spec.engine.stats()
    assert after["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    assert after["spec_draft_tokens"] - before["spec_draft_tokens"] > (
        after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    ), "some drafts were rejected too (the rollback path ran)"
    out = spec.generate([REPEAT], params)[0]
    m = out.metrics
    assert m is not None and m.spec_steps > 0 and 0 < m.spec_accepted_tokens <= m.spec_draft_tokens
    _idle(plain, spec)


def test_prefix_cache_holds_only_the_kv_of_real_tokens(pair) -> None:  # type: ignore[no-untyped-def]
    """Every block the speculating engine registered holds the KV the plain engine computed for
    the same tokens (same hash): no rejected draft's KV is ever found as a prefix."""
    plain, spec = pair
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain.generate(PROMPTS, params)
    spec.generate(PROMPTS, params)
    ref = {b.block_hash: b.block_id for b in plain.engine.kv_manager.pool.blocks if b.block_hash}
    checked = 0
    for block in spec.engine.kv_manager.pool.blocks:
        if block.block_hash is None or block.block_hash not in ref:
            continue
        bs = spec.engine.cache.block_size
        mine = torch.arange(bs) + block.block_id * bs
        theirs = torch.arange(bs) + ref[block.block_hash] * bs
        for layer in range(spec.engine.arch.num_layers):
            k1, v1 = spec.engine.read_kv(mine, layer)
            k2, v2 = plain.engine.read_kv(theirs, layer)
            torch.testing.assert_close(k1, k2, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v1, v2, atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked > 10  # output blocks included: 30 tokens of 4-token blocks per prompt
    _idle(plain, spec)


def test_stop_strings_and_max_tokens_cut_as_without(pair) -> None:  # type: ignore[no-untyped-def]
    plain, spec = pair
    base = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    text = plain.generate([REPEAT], base)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    for params in (
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
    ):
        a, b = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
        for x, y in zip(a, b, strict=True):
            cx, cy = x.outputs[0], y.outputs[0]
            assert (cy.token_ids, cy.text, cy.finish_reason, cy.stop_reason) == (
                cx.token_ids,
                cx.text,
                cx.finish_reason,
                cx.stop_reason,
            )
    _idle(plain, spec)


def test_a_stop_token_among_accepted_drafts_ends_there_with_its_logprobs(pair) -> None:  # type: ignore[no-untyped-def]
    plain, spec = pair
    base = SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)
    tokens = plain.generate([REPEAT], base)[0].outputs[0].token_ids
    params = SamplingParams(
        max_tokens=28, temperature=0, ignore_eos=True, stop_token_ids=[tokens[12]], logprobs=0
    )
    a, b = plain.generate([REPEAT], params)[0].outputs[0], spec.generate([REPEAT], params)[0]
    got = b.outputs[0]
    assert got.token_ids == a.token_ids and got.finish_reason == a.finish_reason == "stop"
    assert got.logprobs is not None and len(got.logprobs) == len(got.token_ids)
    _idle(plain, spec)


def test_n_choices_logprobs_and_seeds(pair) -> None:  # type: ignore[no-untyped-def]
    plain, spec = pair
    greedy = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, n=2, logprobs=2)
    a, b = plain.generate([REPEAT], greedy)[0], spec.generate([REPEAT], greedy)[0]
    assert _ids([a]) == _ids([b])
    for ca, cb in zip(a.outputs, b.outputs, strict=True):
        assert ca.logprobs is not None and cb.logprobs is not None
        assert len(cb.logprobs) == len(cb.token_ids)
        for la, lb in zip(ca.logprobs, cb.logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert list(lb.values()) == pytest.approx(list(la.values()), abs=1e-3)
    seeded = SamplingParams(max_tokens=14, temperature=0.7, seed=5, ignore_eos=True, n=2)
    runs = [_ids(spec.generate([REPEAT], seeded)) for _ in range(2)]
    assert runs[0] == runs[1] and all(len(c) == 14 for c in runs[0])
    _idle(plain, spec)


def test_grammar_requests_are_not_drafted_and_counted(pair) -> None:  # type: ignore[no-untyped-def]
    plain, spec = pair
    params = SamplingParams(max_tokens=12, temperature=0, structured_outputs={"regex": "(ab)+"})
    skips = spec.engine.stats()["spec_grammar_skips"]
    assert _ids(spec.generate([REPEAT], params)) == _ids(plain.generate([REPEAT], params))
    assert spec.engine.stats()["spec_grammar_skips"] > skips
    _idle(plain, spec)


def test_large_batches_are_not_drafted_and_counted(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    spec = LLM(
        str(tiny_llama_path),
        block_size=4,
        num_blocks=256,
        speculative_config={**SPEC, "disable_by_batch_size": 2},
    )
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    spec.generate([REPEAT, REPEAT[1:], RANDOM], params)
    stats = spec.engine.stats()
    assert stats["spec_disabled_steps"] > 0 and stats["spec_draft_tokens"] == 0
    _idle(spec)


def test_handoff_to_a_speculating_decoder(tiny_llama_path, pair) -> None:  # type: ignore[no-untyped-def]
    """P (no speculation, even when configured: P never speculates) prefills, its KV is
    copied to D, D decodes with drafts: the tokens of one plain engine."""
    plain, d = pair
    args = {"block_size": 4, "num_blocks": 256, "phases": "prefill"}
    p = LLM(str(tiny_llama_path), speculative_config=SPEC, **args)
    assert p.engine.spec is None
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    de = d.engine
    accepted = de.stats()["spec_accepted_tokens"]
    for i, prompt in enumerate(PROMPTS):
        want = plain.generate([prompt], params)[0].outputs[0].token_ids
        assert handoff(p, d, prompt, params, rid=f"h{i}") == want
    assert de.stats()["spec_accepted_tokens"] > accepted
    _idle(plain, p, d)
