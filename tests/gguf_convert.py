"""A saved HF model (tiny_arch) written as a GGUF file the way llama.cpp's convert_hf_to_gguf.py
writes it, so tests can check pdserve's GGUF reader (engine/models/gguf_config.py) undoes
exactly what the converter does. Mirrored here per architecture, from the converter's model
classes (LlamaModel, Qwen2Model / Qwen3Model, Qwen2MoeModel / Qwen3MoeModel, Phi3MiniModel,
Gemma2Model, Gemma3Model):

- tensor names: the gguf package's own TensorNameMap, which the converter maps with;
- llama: q and k rows permuted per head (LlamaModel.permute); vocab_size, rope dimension;
- gemma2 / gemma3: 1 added to every `*norm.weight`; no lm_head; Gemma 2 writes no RoPE base,
  its soft-caps and window; Gemma 3 the full-attention RoPE base, linear scaling, the window
  and no sliding-window pattern (llama.cpp assumes 5 sliding layers then a global one);
- phi3: attn_qkv and ffn_up (gate|up) fused as stored; the rope dimension, the original
  context length, the sliding window (0 for none);
- qwen3moe: each layer's experts stacked [expert, out, in] per projection,
  expert_feed_forward_length; no flag for norm_topk_prob (llama.cpp always renormalises);
- 2-D weights in the file type asked for (F32, F16, BF16; `blocks` puts some in a quantized
  format), 1-D tensors in F32, as the converter's default rules.
No tokenizer is written: tests stand the default model's in (model_cache.gguf_tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

ARCHS = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
    "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
    "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
}
_EXPERT_STEMS = ("gate_proj", "up_proj", "down_proj")


def write(
    folder: Path, path: Path, ftype: str = "F32", blocks: dict[str, str] | None = None
) -> Path:
    """The HF model saved in `folder` as the GGUF file `path`: 2-D weights as `ftype`, those
    of the GGUF tensor kinds in `blocks` (e.g. {"attn_qkv": "Q8_0"}) in that block format."""
    cfg: dict[str, Any] = json.loads((folder / "config.json").read_text())
    arch = ARCHS[cfg["architectures"][0]]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    _metadata(writer, arch, cfg)
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    for hf_name, w in _tensors(folder, arch, cfg).items():
        stem, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(stem)}.{suffix}"
        kind = (blocks or {}).get(name.split(".")[2]) if name.startswith("blk.") else None
        _add(writer, name, w, kind or (ftype if w.ndim >= 2 else "F32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: gguf.GGUFWriter, name: str, w: np.ndarray, kind: str) -> None:
    qtype = gguf.GGMLQuantizationType[kind]
    data = np.ascontiguousarray(w, np.float32)
    if kind == "F32":
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _tensors(folder: Path, arch: gguf.MODEL_ARCH, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors by HF name, transformed as the converter transforms them."""
    hf = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    hf.pop("lm_head.weight", None) if arch == gguf.MODEL_ARCH.GEMMA2 else None
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    for name, t in hf.items():
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith("q_proj.weight"):
            t = _permute(t, heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and name.endswith("k_proj.weight"):
            t = _permute(t, kv_heads)
        elif arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3) and name.endswith(
            "norm.weight"
        ):
            t = t + 1
        if ".mlp.experts." not in name:
            out[name] = t.numpy()
    if arch == gguf.MODEL_ARCH.QWEN3MOE:
        out.update(_stacked_experts(hf, cfg))
    return out


def _stacked_experts(hf: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """Qwen2MoeModel.modify_tensors: one [expert, out, in] tensor per layer and projection."""
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        for stem in _EXPERT_STEMS:
            parts = [hf[f"model.layers.{i}.mlp.experts.{e}.{stem}.weight"] for e in range(experts)]
            out[f"model.layers.{i}.mlp.experts.{stem}.weight"] = torch.stack(parts).numpy()
    return out


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """LlamaModel.permute: each head's two RoPE halves interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _metadata(writer: gguf.GGUFWriter, arch: gguf.MODEL_ARCH, cfg: dict[str, Any]) -> None:
    """The keys each converter class writes (its set_gguf_parameters)."""
    writer.add_name("tiny")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_bos_token_id(cfg.get("bos_token_id") or 1)
    writer.add_eos_token_id(cfg.get("eos_token_id") or 2)
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    if "head_dim" in cfg:  # TextModel.set_gguf_parameters; Gemma's own classes too
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    if arch != gguf.MODEL_ARCH.GEMMA2:  # Gemma2Model writes no RoPE base (llama.cpp: 10000)
        writer.add_rope_freq_base(full.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    extra = {
        gguf.MODEL_ARCH.LLAMA: _llama,
        gguf.MODEL_ARCH.PHI3: _phi3,
        gguf.MODEL_ARCH.GEMMA2: _gemma2,
        gguf.MODEL_ARCH.GEMMA3: _gemma3,
        gguf.MODEL_ARCH.QWEN3MOE: _qwen3moe,
    }.get(arch)
    if extra is not None:
        extra(writer, cfg)


def _llama(writer: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_rope_dimension_count(
        cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    )


def _phi3(writer: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    rope = cfg.get("rope_parameters") or {}
    rot = rope.get("partial_rotary_factor", 1.0)
    writer.add_rope_dimension_count(int(rot * cfg["hidden_size"]) // cfg["num_attention_heads"])
    orig = rope.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(orig)
    writer.add_sliding_window(cfg.get("sliding_window") or 0)


def _gemma2(writer: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_sliding_window(cfg["sliding_window"])


def _gemma3(writer: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    if cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_sliding_window(cfg["sliding_window"])


def _qwen3moe(writer: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
