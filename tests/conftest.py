"""Shared fixtures: tiny random HF models (Llama, Qwen2 with bias) saved as safetensors folders
with the default model's tokenizer, and the default SmolLM2 engine, each built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_VOCAB = 49152  # the SmolLM2 tokenizer's, so tiny models take real text prompts


def _save_tiny(folder: Path, kind: str, tokenizer) -> Path:  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    cfg = cfg_cls(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=kind == "qwen2",
        bos_token_id=1,
        eos_token_id=2,
        rope_theta=10000.0,
    )
    torch.manual_seed(1234)
    model = model_cls(cfg)
    if kind == "qwen2":  # random non-zero biases so the bias path is really exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def default_tokenizer():  # type: ignore[no-untyped-def]
    from pdserve.engine import loader

    return loader.load_tokenizer(loader.resolve_model(None))


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, default_tokenizer) -> Path:  # type: ignore[no-untyped-def]
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama", default_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory, default_tokenizer) -> Path:  # type: ignore[no-untyped-def]
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", default_tokenizer)


@pytest.fixture(scope="session")
def smollm2():  # type: ignore[no-untyped-def]
    """The default model, loaded once (about 10 s)."""
    from pdserve import LLM

    return LLM()


def assert_engine_idle(llm) -> None:  # type: ignore[no-untyped-def]
    """Leak check for a whole engine: nothing alive, every KV block free."""
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
    assert not eng._live
