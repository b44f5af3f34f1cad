"""Model variants beyond the two tiny fixtures: llama3 RoPE scaling, Mistral, bfloat16, CUDA."""

from __future__ import annotations

import pytest
import torch

from factories import TINY_VOCAB, assert_engine_idle
from pdserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _save(folder, kind: str, tokenizer, **extra):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    cfg_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[kind]
    cfg = cfg_cls(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    torch.manual_seed(99)
    model = model_cls(cfg).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (3, 40, 150)]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    ids = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        (
            "llama",
            dict(
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
        ),
        ("mistral", dict(rope_theta=1000000.0, sliding_window=None)),
    ],
)
def test_variant_matches_hf(tmp_path, default_tokenizer, kind, extra) -> None:  # type: ignore[no-untyped-def]
    ref = _save(tmp_path, kind, default_tokenizer, **extra)
    llm = LLM(str(tmp_path), block_size=8, num_blocks=128)
    if kind == "llama":
        assert llm.engine.arch.rope_scaling is not None
    prompts = _prompts()
    with torch.no_grad():
        want_logits = ref(torch.tensor([prompts[2]])).logits[0, -1]
    got = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [_hf_greedy(ref, p, 12) for p in prompts]
    # And the logits of the longest prompt's last position, through the engine's own path.
    out = llm.generate([prompts[2]], SamplingParams(max_tokens=1, temperature=0, logprobs=1))
    top = max(out[0].outputs[0].logprobs[0].items(), key=lambda kv: kv[1])[0]
    assert top == int(want_logits.argmax())
    assert_engine_idle(llm)


def test_bfloat16_runs_close_to_float32(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    prompts = _prompts()
    f32 = LLM(str(tiny_llama_path), block_size=8, num_blocks=128)
    bf16 = LLM(str(tiny_llama_path), block_size=8, num_blocks=128, dtype="bfloat16")
    assert bf16.engine.cache.layers[0][0].dtype == torch.bfloat16
    assert next(bf16.engine.model.parameters()).dtype == torch.bfloat16
    p = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    for a, b in zip(f32.generate(prompts, p), bf16.generate(prompts, p), strict=True):
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        shared = set(la) & set(lb)
        assert len(shared) >= 3  # the top-5 sets mostly agree
        assert all(abs(la[t] - lb[t]) < 0.1 for t in shared)
    assert_engine_idle(bf16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    prompts = _prompts()
    cpu = LLM(str(tiny_llama_path), block_size=8, num_blocks=128)
    gpu = LLM(str(tiny_llama_path), block_size=8, num_blocks=128, device="cuda")
    assert [o.outputs[0].token_ids for o in cpu.generate(prompts, GREEDY)] == [
        o.outputs[0].token_ids for o in gpu.generate(prompts, GREEDY)
    ]
    assert_engine_idle(gpu)
