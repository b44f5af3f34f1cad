"""Every supported architecture against transformers, on tiny random-weight models (tiny_arch):
greedy tokens equal transformers' float32 greedy tokens on prompts shorter and longer than the
sliding window, through each attention path (the paged kernel, gathered blocks, prompts cut
into chunks over their own cached prefix), and the logprobs of the last prompt position equal
transformers' (soft-capped final logits included)."""

from __future__ import annotations

import pytest
import torch

import tiny_arch
from factories import assert_engine_idle
from pdserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(tiny_arch.VARIANTS))
def variant(request, tmp_path_factory, default_tokenizer):  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp(request.param)
    model = tiny_arch.save(folder, request.param, default_tokenizer)
    prompts = tiny_arch.prompts()
    want = [tiny_arch.hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    return request.param, folder, model, prompts, want


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_greedy_tokens_and_logprobs_equal_transformers(variant) -> None:  # type: ignore[no-untyped-def]
    name, folder, ref, prompts, want = variant
    llm = LLM(str(folder), block_size=8, num_blocks=256)
    assert llm.engine.arch.architecture == name.split("-")[0].split(".")[0].replace(
        "llama3", "llama"
    )
    assert _tokens(llm, prompts) == want
    with torch.no_grad():
        ref_lp = torch.log_softmax(ref(torch.tensor([prompts[2]])).logits[0, -1], -1)
    out = llm.generate([prompts[2]], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    got = out[0].outputs[0].logprobs[0]
    assert got and all(abs(lp - ref_lp[t].item()) < 1e-4 for t, lp in got.items())
    assert_engine_idle(llm)


@pytest.mark.slow  # 16 engines: the fast suite keeps the greedy parity of every variant
@pytest.mark.parametrize("attention", ["gather", "paged"])
def test_chunked_prompts_over_their_cached_prefix(variant, attention) -> None:  # type: ignore[no-untyped-def]
    """Steps of at most 40 tokens: the 150-token prompt runs as chunks over its own cached
    prefix (past the window), the 40-token one as one chunk; decodes gathered or in place."""
    _, folder, _, prompts, want = variant
    llm = LLM(
        str(folder), block_size=8, num_blocks=256, attention=attention, max_num_batched_tokens=40
    )
    assert _tokens(llm, prompts) == want
    assert_engine_idle(llm)
