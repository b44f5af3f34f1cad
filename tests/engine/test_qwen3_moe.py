"""Qwen3-MoE beyond tests/engine/test_architectures.py's parity with transformers (variants
`qwen3_moe`, `qwen3_moe-norm`): which layers get experts (mlp_only_layers,
decoder_sparse_step), the config values refused, and its experts and dense layer quantized
(w8g32) against float."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen3MoeConfig

import tiny_arch
from factories import assert_engine_idle, greedy_agreement
from pdserve import LLM, SamplingParams
from pdserve.engine import loader, quantize
from pdserve.engine.linear.w8g32 import W8G32Linear
from pdserve.engine.models.arch import MoeArch

TINY: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32,
)  # fmt: skip


def _arch_of(folder: Path, **cfg: Any) -> Any:
    config = Qwen3MoeConfig(**{**TINY, **cfg})
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")
    return loader.load_arch(loader.resolve_model(folder))


@pytest.mark.parametrize(
    ("cfg", "dense"),
    [
        ({}, ()),
        ({"decoder_sparse_step": 2}, (0, 2)),  # experts where (i + 1) % step == 0
        ({"mlp_only_layers": [0, 3]}, (0, 3)),
        ({"decoder_sparse_step": 2, "mlp_only_layers": [1]}, (0, 1, 2)),
    ],
)
def test_the_layers_with_experts_are_transformers(
    cfg: dict[str, Any], dense: tuple[int, ...], tmp_path: Path
) -> None:
    arch = _arch_of(tmp_path, norm_topk_prob=True, **cfg)
    assert arch.architecture == "qwen3_moe" and arch.family.qk_norm
    assert arch.moe == MoeArch(4, 2, True, 32, dense)
    assert [arch.moe_at(i) is None for i in range(4)] == [i in dense for i in range(4)]


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be an integer >= 1"),
        ({"mlp_only_layers": [4]}, r"mlp_only_layers=\[4\] must list layer indices in \[0, 4\)"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 must be in \[1, num_experts=4\]"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ],
)
def test_a_config_we_do_not_implement_is_refused_naming_the_field(
    cfg: dict[str, Any], message: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=message) as err:
        _arch_of(tmp_path, **cfg)
    assert "config.json" in str(err.value)


def test_w8g32_quantizes_experts_and_the_dense_layer(
    tmp_path: Path, default_tokenizer: Any
) -> None:
    tiny_arch.save(tmp_path, "qwen3_moe", default_tokenizer)  # layer 1 dense
    f32 = LLM(str(tmp_path), block_size=8, num_blocks=128)
    w8 = LLM(str(tmp_path), block_size=8, num_blocks=128, quantization="w8g32")
    layers = quantize.layers_of(w8.engine.model)
    assert [layer.moe is None for layer in layers] == [False, True, False]
    assert isinstance(layers[1].quantized["gate_up"], W8G32Linear)  # the dense MLP
    for i in (0, 2):
        moe = layers[i].moe
        assert moe is not None and moe.quantized is not None and len(moe.quantized) == 4
        assert all(isinstance(p, W8G32Linear) for pair in moe.quantized for p in pair)
    prompts = tiny_arch.prompts()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got, want = (
        [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] for llm in (w8, f32)
    )
    # Random tiny weights have flat logits (near ties): looser than a real model would be.
    assert greedy_agreement(list(want), list(got)) >= 0.6
    assert quantize.projection_bytes(w8.engine.model) < 0.4 * quantize.projection_bytes(
        f32.engine.model
    )
    assert_engine_idle(w8)


def test_a_qwen3_moe_checkpoint_loads_under_mixtral_expert_names(
    tmp_path: Path, default_tokenizer: Any
) -> None:
    """The router and experts of the sparse layers renamed (mlp.gate -> block_sparse_moe.gate,
    experts.{e}.gate/up/down_proj -> w1/w3/w2), the dense layer's mlp.*_proj kept."""
    model = tiny_arch.save(tmp_path, "qwen3_moe", default_tokenizer)
    src = loader.resolve_model(tmp_path)
    weights = loader.load_weights(src, loader.load_arch(src))
    experts = model.model.layers[0].mlp.experts  # transformers 5: [E, 2I, h] gate|up fused
    gate, up = experts.gate_up_proj[2].chunk(2)
    assert torch.equal(weights["model.layers.0.block_sparse_moe.experts.2.w1.weight"], gate)
    assert torch.equal(weights["model.layers.0.block_sparse_moe.experts.2.w3.weight"], up)
    assert torch.equal(
        weights["model.layers.2.block_sparse_moe.experts.3.w2.weight"],
        model.model.layers[2].mlp.experts.down_proj[3],
    )
    assert torch.equal(
        weights["model.layers.0.block_sparse_moe.gate.weight"],
        model.model.layers[0].mlp.gate.weight,
    )
    dense = model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(weights["model.layers.1.mlp.down_proj.weight"], dense)
