"""The HF checkpoint layout of every family: which tensors a model has, under which names, and
how they fill the model's fused parameters.

The loader hands over tensors under HF names (a GGUF file's are renamed to them), so this is
the one place that knows them. Phi-3's fused q|k|v and gate|up tensors are split back into the
Llama names here (`split_fused`), so quantization and the GGUF side see one naming scheme.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from pdserve.engine.models import moe
from pdserve.engine.models.arch import ModelArch


def layer_norm_names(arch: ModelArch) -> dict[str, str]:
    """The layer's norms: our parameter name -> HF tensor name (under model.layers.{i}.)."""
    names = {"input_norm": "input_layernorm"}
    if arch.family.sandwich_norms:  # Gemma: its post_attention norm is on the attention output
        names |= {
            "attn_out_norm": "post_attention_layernorm",
            "post_norm": "pre_feedforward_layernorm",
            "mlp_out_norm": "post_feedforward_layernorm",
        }
    else:
        names["post_norm"] = "post_attention_layernorm"
    if arch.family.qk_norm:
        names |= {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
    return names


def expected_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every parameter the model code expects, with its torch shape, in a stable order."""
    h, q_dim = arch.hidden_size, arch.num_heads * arch.head_dim
    kv_dim, inter = arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    norms = layer_norm_names(arch)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        for ours, theirs in norms.items():
            shapes[f"{p}{theirs}.weight"] = (
                (arch.head_dim,) if ours in ("q_norm", "k_norm") else (h,)
            )
        for proj, out_dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (out_dim, h)
            if arch.attention_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (out_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_dim)
        if arch.moe_at(i) is not None:  # the router and experts (models/moe.py)
            shapes.update(moe.hf_shapes(arch, p))
            continue
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


def fused_parts(name: str, arch: ModelArch) -> list[tuple[str, int, int]] | None:
    """Phi-3's fused tensor `name` as its parts' Llama names and row ranges [start, end):
    qkv_proj [q + 2 kv, h] as q/k/v_proj, gate_up_proj [2 inter, h] (gate first, as Phi3MLP
    chunks it) as gate/up_proj; None for any other tensor or family."""
    if not arch.family.fused_checkpoint:
        return None
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    if name.endswith("self_attn.qkv_proj.weight"):
        p = name.removesuffix("qkv_proj.weight")
        return [(p + "q_proj.weight", 0, q), (p + "k_proj.weight", q, q + kv),
                (p + "v_proj.weight", q + kv, q + 2 * kv)]  # fmt: skip
    if name.endswith("mlp.gate_up_proj.weight"):
        p, i = name.removesuffix("gate_up_proj.weight"), arch.intermediate_size
        return [(p + "gate_proj.weight", 0, i), (p + "up_proj.weight", i, 2 * i)]
    return None


def split_fused(weights: dict[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """Phi-3's fused q|k|v and gate|up tensors as Llama's (`fused_parts`), in place; other
    families unchanged."""
    for name in list(weights):
        parts = fused_parts(name, arch)
        if parts is None:
            continue
        fused = weights.pop(name)
        check_fused_rows(name, fused.shape[0], parts)
        for part, start, end in parts:
            weights[part] = fused[start:end]
    return weights


def check_fused_rows(name: str, rows: int, parts: list[tuple[str, int, int]]) -> None:
    """A fused tensor must hold exactly its parts' rows: none cut off, none left over."""
    if rows != parts[-1][2]:
        raise ValueError(
            f"{name}: {rows} rows, expected {parts[-1][2]} (the rows of "
            f"{', '.join(p.rsplit('.', 2)[-2] for p, _, _ in parts)})"
        )


def fill(model: nn.Module, arch: ModelArch, weights: dict[str, torch.Tensor]) -> None:
    """Copy HF-named tensors into the model's fused parameters; every parameter must be filled.

    `model` is a models/llama.py `LlamaModel` of `arch`, typed as a module because that file
    imports this one. Gemma's norms scale by (1 + w): the offset is added here, once, so every
    norm (torch's or the native one) runs the plain x * rsqrt(mean(x^2) + eps) * w."""
    filled: set[str] = set()
    params = dict(model.named_parameters())
    offset = arch.family.norm_offset

    def put(name: str, value: torch.Tensor, transpose: bool = False, norm: bool = False) -> None:
        value = value.t() if transpose else value
        if tuple(value.shape) != tuple(params[name].shape):
            raise ValueError(
                f"{name}: shape {tuple(value.shape)}, expected {tuple(params[name].shape)}"
            )
        value = value.to(params[name].dtype)
        if norm and offset:
            value = value.float().add(offset).to(params[name].dtype)
        params[name].data = value.contiguous()
        filled.add(name)

    put("embed", weights["model.embed_tokens.weight"])
    put("norm", weights["model.norm.weight"], norm=True)
    tied = arch.tie_word_embeddings
    head = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]
    put("lm_head", head, transpose=True)
    norms = layer_norm_names(arch)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        for ours, theirs in norms.items():
            put(f"layers.{i}.{ours}", weights[f"{p}{theirs}.weight"], norm=True)
        qkv = torch.cat([weights[a + f"{n}_proj.weight"] for n in "qkv"])
        put(f"layers.{i}.qkv", qkv, transpose=True)
        if arch.attention_bias:
            bias = torch.cat([weights[a + f"{n}_proj.bias"] for n in "qkv"])
            put(f"layers.{i}.qkv_bias", bias)
        put(f"layers.{i}.o", weights[a + "o_proj.weight"], transpose=True)
        layer = cast(nn.ModuleList, model.layers)[i]
        if (sparse := cast("moe.SparseMoe | None", layer.moe)) is not None:  # models/moe.py
            for name, value in sparse.hf_weights(weights, p).items():
                put(f"layers.{i}.moe.{name}", value)
            continue
        gate_up = torch.cat([weights[m + "gate_proj.weight"], weights[m + "up_proj.weight"]])
        put(f"layers.{i}.gate_up", gate_up, transpose=True)
        put(f"layers.{i}.down", weights[m + "down_proj.weight"], transpose=True)
    missing = {n for n, _ in model.named_parameters()} - filled
    if missing:
        raise ValueError(f"weights missing for parameters: {sorted(missing)[:5]}")
