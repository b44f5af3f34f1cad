"""The default model end to end: SmolLM2-135M-Instruct from its GGUF file."""

from __future__ import annotations

import torch

from factories import assert_engine_idle
from pdserve import SamplingParams


def test_the_default_runs_the_files_own_weights(smollm2) -> None:  # type: ignore[no-untyped-def]
    # `--quantization auto`: the Q4_1 file's own weights against int16 activations (gguf-a16),
    # over a float16 KV cache.
    assert smollm2.engine.quantization == "gguf-a16"
    assert smollm2.engine.cache.dtype == torch.float16


def test_greedy_matches_transformers_gguf(smollm2) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    from pdserve import LLM

    # Exact greedy parity is `none`'s promise: float32 weights as transformers loads them.
    llm = LLM(quantization="none")
    src = llm.engine.source
    ref = AutoModelForCausalLM.from_pretrained(
        src.folder, gguf_file=src.gguf_file, dtype=torch.float32
    ).eval()
    tok = llm.get_tokenizer()
    prompts = ["The capital of Germany is", "def fibonacci(n):", "Water boils at"]
    ours = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, ours, strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        want = ref.generate(
            ids,
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
        )[0, ids.shape[1] :].tolist()
        assert out.outputs[0].token_ids == want
    assert_engine_idle(llm)


def test_chat_knows_the_capital_of_france(smollm2) -> None:  # type: ignore[no-untyped-def]
    out = smollm2.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=32, temperature=0),
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ended on <|im_end|>, not on the length cap
    assert_engine_idle(smollm2)
