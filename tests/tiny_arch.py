"""Tiny random-weight models of every supported architecture, built from transformers' own
config classes (nothing downloaded) and saved with the default tokenizer, and the oracle that
checks pdserve against them: transformers' float32 greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from factories import TINY_VOCAB

COMMON: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
WINDOW = 48  # sliding window of the windowed variants: prompts of 150 tokens run past it

# name -> (config class, model class, config arguments beyond COMMON)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": (
        "Qwen3Config", "Qwen3ForCausalLM",
        dict(num_hidden_layers=2, head_dim=32, tie_word_embeddings=True, rope_theta=1e6),
    ),
    # Qwen2.5's shape: tied, rope_theta 1e6, a sliding_window value the config switches off.
    "qwen2.5": (
        "Qwen2Config", "Qwen2ForCausalLM",
        dict(num_hidden_layers=2, tie_word_embeddings=True, rope_theta=1e6,
             use_sliding_window=False, sliding_window=16, max_window_layers=2),
    ),
    # Llama 3.2's: tied, rope_theta 5e5, llama3 scaling (its original context shortened so
    # that the scaled and unscaled frequencies differ within these prompts).
    "llama3.2": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(num_hidden_layers=2, tie_word_embeddings=True, rope_theta=500000.0,
             rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ),
    # Qwen3-MoE as transformers' default: the softmax's top-k weights kept as they are
    # (norm_topk_prob false), and a dense layer between two of experts (mlp_only_layers).
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(num_hidden_layers=3, head_dim=16, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[1]),
    ),
    # As the real ones (Qwen3-30B-A3B): every layer's MLP experts, top-k weights renormalised.
    "qwen3_moe-norm": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(num_hidden_layers=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, norm_topk_prob=True, rope_theta=1e6),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_hidden_layers=2)),
    "phi3-window": ("Phi3Config", "Phi3ForCausalLM", dict(num_hidden_layers=2, sliding_window=40)),
    "mistral-window": (
        "MistralConfig", "MistralForCausalLM",
        dict(num_hidden_layers=2, head_dim=16, sliding_window=WINDOW),
    ),
    "gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
             attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    ),
    "gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
             layer_types=["sliding_attention", "full_attention"] * 2,
             rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
             }),
    ),
}  # fmt: skip


def build(name: str, **overrides: Any) -> torch.nn.Module:
    """transformers' model of variant `name`, random weights (seeded), float32, eval mode.

    Weights are drawn wider than the config's init (std 0.02) and every norm weight is
    perturbed, so soft-caps, q/k norms and Gemma's (1 + w) norms change the result."""
    import transformers

    cfg_name, model_name, extra = VARIANTS[name]
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra, **overrides})
    cfg.initializer_range = 0.1
    torch.manual_seed(1234)
    model = getattr(transformers, model_name)(cfg).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def save(folder: Path, name: str, tokenizer: Any, **overrides: Any) -> torch.nn.Module:
    model = build(name, **overrides)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return model


def prompts(lengths: tuple[int, ...] = (3, 40, 150), seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = model.generate(  # type: ignore[operator]
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    return ids[0, len(prompt) :].tolist()
