"""Sampling through the whole engine: seeds, top-k/top-p, stop strings, logprobs, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from factories import assert_engine_idle
from pdserve import LLM, SamplingParams
from pdserve.engine.sampler import filter_logits


@pytest.fixture(scope="module")
def llm(tiny_llama_path) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(tiny_llama_path), block_size=4, num_blocks=256, max_model_len=256)


PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time in a land"]


def _ids(outs) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [o.outputs[0].token_ids for o in outs]


def test_same_seed_same_output_regardless_of_batch(llm) -> None:  # type: ignore[no-untyped-def]
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    alone = _ids(llm.generate(PROMPTS[:1], p))
    batched = _ids(llm.generate(PROMPTS, p))
    again = _ids(llm.generate(PROMPTS, p))
    assert batched == again
    assert batched[0] == alone[0]
    other = _ids(
        llm.generate(
            PROMPTS[:1], SamplingParams(max_tokens=12, temperature=1.0, seed=43, ignore_eos=True)
        )
    )
    assert other != alone  # a random tiny model is near-uniform: different seeds diverge
    assert_engine_idle(llm)


def test_top_k_1_equals_greedy(llm) -> None:  # type: ignore[no-untyped-def]
    greedy = _ids(
        llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    )
    topk1 = _ids(
        llm.generate(
            PROMPTS,
            SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3, ignore_eos=True),
        )
    )
    assert topk1 == greedy


def test_filter_keeps_exactly_top_k_and_nucleus() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    kept = torch.isfinite(filter_logits(logits, 2, 1.0)).nonzero().flatten().tolist()
    assert kept == [1, 3]
    probs = torch.softmax(logits, -1)  # sorted: 1 (.64), 3 (.23), 2 (.09), ...
    assert probs[1] < 0.7
    kept = torch.isfinite(filter_logits(logits, -1, 0.7)).nonzero().flatten().tolist()
    assert kept == [1, 3]  # .64 < .7, so the second token is needed; .87 >= .7 stops there
    kept = torch.isfinite(filter_logits(logits, -1, 0.5)).nonzero().flatten().tolist()
    assert kept == [1]


def test_sampled_tokens_stay_inside_top_k(llm) -> None:  # type: ignore[no-untyped-def]
    # With top_k=3 and greedy as a reference, each sampled token must be among the top 3 there.
    prompt = llm.get_tokenizer().encode("Hello there")
    p = SamplingParams(max_tokens=1, temperature=2.0, top_k=3, seed=0, logprobs=3)
    for seed in range(5):
        p.seed = seed
        out = llm.generate([prompt], p)[0].outputs[0]
        top3 = set(list(out.logprobs[0])[1:] if len(out.logprobs[0]) > 3 else out.logprobs[0])
        assert out.token_ids[0] in top3


def test_stop_strings_cut_exactly(llm) -> None:  # type: ignore[no-untyped-def]
    base = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[
        0
    ].outputs[0]
    text = base.text
    assert len(text) > 10
    stop = text[5:9]  # a piece from the middle of what greedy decoding writes
    first = text.find(stop)
    out = llm.generate(
        PROMPTS[1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.text == text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(base.token_ids)
    assert_engine_idle(llm)


def test_stop_token_ids_and_max_tokens(llm) -> None:  # type: ignore[no-untyped-def]
    base = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[
        0
    ].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 8
    target = base.token_ids[3]
    out = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[target])
    )[0].outputs[0]
    cut = base.token_ids.index(target)
    assert out.token_ids == base.token_ids[: cut + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_logprobs(llm) -> None:  # type: ignore[no-untyped-def]
    out = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=4, temperature=0, logprobs=5, ignore_eos=True)
    )[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in lp and len(lp) == 5  # greedy token is the top-1, so 5 distinct entries
        assert lp[tok] == max(lp.values()) and lp[tok] <= 0
        assert all(math.isfinite(v) for v in lp.values())


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
    ],
)
def test_bad_sampling_params_raise(kwargs, words) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_lose_nothing(llm) -> None:  # type: ignore[no-untyped-def]
    p = SamplingParams(max_tokens=4, temperature=0)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], p)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], p)
    with pytest.raises(ValueError, match="shorten the prompt"):
        llm.generate([[5] * 300], p)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[5, 10**9]], p)
    # A bad prompt in a batch adds nothing: the good ones before it were withdrawn.
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], p)
    assert_engine_idle(llm)
    assert llm.generate(["fine"], p)[0].finished


def test_context_full_finishes_with_length(llm) -> None:  # type: ignore[no-untyped-def]
    out = llm.generate([[5] * 250], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[
        0
    ].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_unknown_engine_argument_and_model_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(None, block_sise=4)
    with pytest.raises(ValueError, match="gguf"):
        LLM(str(tmp_path / "nope"))
