"""A GGUF file's metadata -> ModelArch, and its tensor names -> the HF names the model code reads,
following llama.cpp's conventions: what its convert_hf_to_gguf.py writes and its loader
(src/llama-model.cpp, src/models/*.cpp) assumes, per architecture.

What a converted file departs from its HF checkpoint in, undone or mirrored here:
  * llama (Llama, Mistral, Mixtral): q and k rows permuted within each head (`unpermute_rows`);
    llama3 RoPE scaling stored only as a `rope_freqs` tensor; a Mixtral's experts as 3-D
    ffn_*_exps tensors [expert, out, in] (models/moe.py).
  * qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3: NeoX RoPE, nothing permuted.
  * phi3: q|k|v fused in attn_qkv, gate|up in ffn_up, split as the HF checkpoint's are
    (models/checkpoint.py `fused_parts`).
  * gemma2, gemma3: every `*norm.weight` stored with 1 added (llama.cpp's RMSNorm scales by w),
    taken off as the weights load so they are the checkpoint's (`NORM_OFFSET_ADDED`); ffn_norm
    is the pre-MLP norm, post_attention_norm / post_ffw_norm the outer ones. No
    query_pre_attn_scalar key: llama.cpp scales queries by 1/sqrt(head_dim), or by
    1/sqrt(hidden / heads) for the 27B models, which it knows by their layer count. Which
    layers slide: attention.sliding_window_pattern (a period, or a flag per layer), else
    llama.cpp's fixed period (2 for Gemma 2, 6 for Gemma 3; the last layer of each period is
    global). Gemma 2's window and soft-caps are llama.cpp's defaults (4096, 50, 30) where the
    keys are missing; Gemma 3's sliding layers rotate with rope.freq_base_swa (10000 where
    missing), unscaled.
  * qwen3moe: every layer's MLP is experts, expert_feed_forward_length wide (else
    feed_forward_length / expert_used_count, as llama.cpp); the chosen experts' weights are
    renormalised (llama.cpp always does; an expert_weights_norm key overrides).
  * a sliding_window key on llama / qwen / phi3: every layer slides, as in HF's Mistral and
    Phi-3 (llama.cpp's phi3 ignores its window, and its converters write none for the others).
Anything else the metadata switches on (another RoPE scaling, LongRoPE factors, shared
experts, another gating function, partial rotary) is refused naming the file and the key.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.engine.models import moe
from pdserve.engine.models.arch import FAMILIES, ModelArch, MoeArch

if TYPE_CHECKING:
    from pdserve.engine.model_cache import GgufIndex

# general.architecture -> the family (models/arch.py FAMILIES) it is read as.
GGUF_ARCHITECTURES = {
    "llama": "llama",  # also Mistral and Mixtral, as llama.cpp writes them
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
}
# Architectures whose q / k rows convert_hf_to_gguf permutes (LlamaModel.permute).
PERMUTED = ("llama",)
# Architectures whose norm weights the converter stored with 1 added.
NORM_OFFSET_ADDED = ("gemma2", "gemma3")

# Tensors llama.cpp adds that carry no learned weight for us (rope_freqs is read by _rope).
_IGNORED = frozenset({"rope_freqs.weight"})
_REFUSED = {
    "rope_factors_long.weight": "LongRoPE scaling (Phi-3's long-context models)",
    "rope_factors_short.weight": "LongRoPE scaling (Phi-3's long-context models)",
}
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    **moe.GGUF_BLOCK,
}
_GEMMA_BLOCK = {
    **_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCKS = {
    "phi3": {**_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA_BLOCK,
    "gemma3": _GEMMA_BLOCK,
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's fixed sliding-window period per architecture (set_swa_pattern); 0: every layer.
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
# The Gemma 27B models' layer counts: llama.cpp scales their queries by 1/sqrt(hidden / heads).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's enum llama_expert_gating_func_type: the softmax SparseMoe routes with.
_GATING_SOFTMAX = 1


def hf_name(gguf_name: str, arch: str, path: Path) -> str | None:
    """The HF parameter name of GGUF tensor `gguf_name` in a file of architecture `arch`; None
    for llama.cpp-only tensors we ignore. Unknown or refused tensors raise, naming both."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    if gguf_name in _IGNORED:
        return None
    if gguf_name in _REFUSED:
        raise ValueError(f"{path}: tensor {gguf_name} ({_REFUSED[gguf_name]}) is not supported.")
    block = _BLOCKS.get(arch, _BLOCK)
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m[2] not in block:
        raise ValueError(f"{path}: unknown tensor {gguf_name!r} for GGUF architecture {arch!r}.")
    return f"model.layers.{m[1]}.{block[m[2]]}.{m[3]}"


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's permute, which interleaves each head's two RoPE halves.

    Forward: w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2).reshape(shape).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class _Meta:
    """The `{arch}.*` metadata of one file, each refusal naming the file and the key."""

    path: Path
    index: GgufIndex
    arch: str

    def get(self, key: str, default: Any = None) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.index.metadata and full in self.index.array_lengths:
            raise self.refuse(key, f"<{self.index.array_lengths[full]} values>", "too long")
        return self.index.field(full, default)

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise ValueError(f"{self.path}: metadata key {self.arch}.{key} is missing.")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.refuse(key, value, "a number is expected")
        return int(value)

    def refuse(self, key: str, value: object, why: str) -> ValueError:
        return ValueError(f"{self.path}: {self.arch}.{key}={value!r} is not supported ({why}).")


def arch_from_gguf(path: Path, index: GgufIndex) -> ModelArch:
    """The ModelArch of a GGUF file, refusing before any weight loads an architecture, tensor,
    tensor type or metadata key this engine does not implement."""
    gguf_arch = index.field("general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: general.architecture={gguf_arch!r} is not supported; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)}."
        )
    tensors = check_tensors(path, index, gguf_arch)
    meta = _Meta(path, index, gguf_arch)
    heads, hidden, layers = (
        meta.int("attention.head_count"), meta.int("embedding_length"), meta.int("block_count")
    )  # fmt: skip
    head_dim = meta.int("attention.key_length", hidden // heads)
    if (rotary := meta.int("rope.dimension_count", head_dim)) != head_dim:
        raise meta.refuse("rope.dimension_count", rotary, f"RoPE rotates whole {head_dim}-d heads")
    theta, scaling, local_theta = _rope(meta, head_dim)
    window, layer_types = _sliding(meta, layers)
    family = GGUF_ARCHITECTURES[gguf_arch]
    return ModelArch(
        architecture=family,
        vocab_size=tensors["token_embd.weight"].shape[1],  # GGUF's order: [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=meta.int("feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=meta.int("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=meta.int("context_length", 2048),
        # llama.cpp drops output.weight when it equals the embedding.
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=index.field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(index),
        name=str(index.field("general.name") or path.stem),
        moe=_moe(meta, family),
        hidden_act="gelu_tanh" if FAMILIES[family].sandwich_norms else "silu",
        sliding_window=window,
        layer_types=layer_types,
        local_rope_theta=local_theta,
        **_gemma(meta, family, hidden, heads, head_dim, layers),
    )


def check_tensors(path: Path, index: GgufIndex, arch: str) -> dict[str, Any]:
    """Every tensor by GGUF name, each name known (`hf_name`) and each weight's type one the
    gguf package dequantizes; else ValueError naming the file, the tensor and its type."""
    for t in index.tensors:
        if hf_name(t.name, arch, path) is not None and not _dequantizable(t.tensor_type):
            raise ValueError(
                f"{path}: tensor {t.name} is stored as {t.qtype.name}, which cannot be read as "
                "weights here (no dequantization for it in the gguf package)."
            )
    tensors = {t.name: t for t in index.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: no token_embd.weight tensor (the token embeddings).")
    return tensors


@functools.cache
def _dequantizable(tensor_type: int) -> bool:
    """Can the gguf package turn this type's blocks into floats? (One zero block, tried.)"""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(tensor_type)
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _eos_ids(index: GgufIndex) -> tuple[int, ...]:
    """EOS plus llama.cpp's end-of-turn / end-of-message ids: all of them end a generation."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = (index.field(f"tokenizer.ggml.{k}") for k in keys)
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _rope(meta: _Meta, head_dim: int) -> tuple[float, dict[str, Any] | None, float | None]:
    """(RoPE base, its scaling, the sliding layers' own base or None)."""
    theta = float(meta.get("rope.freq_base", 10000.0))
    kind = meta.get("rope.scaling.type", "none")
    scaling: dict[str, Any] | None = None
    if kind == "linear":
        factor = float(meta.get("rope.scaling.factor", 1.0))
        scaling = {"rope_type": "linear", "factor": factor} if factor != 1.0 else None
    elif kind not in ("none", ""):
        raise meta.refuse("rope.scaling.type", kind, "supported: none, linear; llama3 as a "
                          "rope_freqs tensor")  # fmt: skip
    freqs = _llama3_scaling(meta, theta, head_dim)
    if freqs is not None and scaling is not None:
        raise meta.refuse("rope.scaling.type", kind, "a rope_freqs tensor too")
    local = meta.get("rope.freq_base_swa", 10000.0 if meta.arch == "gemma3" else None)
    return theta, freqs or scaling, None if local is None else float(local)


def _llama3_scaling(meta: _Meta, theta: float, head_dim: int) -> dict[str, Any] | None:
    """Recover llama3 RoPE scaling, which llama.cpp stores only as a `rope_freqs` factor tensor.

    The GGUF has no llama3 parameters, so rebuild them with convert_hf_to_gguf's defaults
    (low 1, high 4, original context 8192, as in every Llama 3.x) and check they reproduce the
    stored factors exactly; anything else is refused rather than silently mis-rotated.
    """
    freqs = next((t for t in meta.index.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    from gguf.quants import dequantize

    data = meta.index.data(np.memmap(meta.path, dtype=np.uint8, mode="r"), freqs)
    stored = dequantize(data, freqs.qtype).astype(np.float64).reshape(-1)
    scaling = {
        "rope_type": "llama3",
        "factor": float(stored.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(llama3_factors(scaling, theta, head_dim), stored, rtol=1e-5):
        raise ValueError(f"{meta.path}: rope_freqs does not match llama3 scaling; not supported.")
    return scaling


def llama3_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors exactly as llama.cpp's convert_hf_to_gguf writes rope_freqs."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def _sliding(meta: _Meta, layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(the window, "sliding" | "full" per layer); (None, ()) when no layer slides."""
    window = meta.get("attention.sliding_window", 4096 if meta.arch == "gemma2" else None)
    if not window:
        return None, ()
    pattern = meta.get("attention.sliding_window_pattern", _SWA_PERIOD.get(meta.arch, 0))
    if isinstance(pattern, list):  # one flag per layer, true: sliding
        if len(pattern) != layers or any(not isinstance(p, bool) for p in pattern):
            raise meta.refuse("attention.sliding_window_pattern", pattern,
                              f"{layers} true / false flags or a period expected")  # fmt: skip
        types = tuple("sliding" if p else "full" for p in pattern)
    else:
        types = swa_pattern(int(pattern), layers)
    return (int(window), types) if "sliding" in types else (None, ())


def swa_pattern(period: int, layers: int) -> tuple[str, ...]:
    """llama.cpp's set_swa_pattern: with period p, layer i slides when i % p < p - 1 (the last
    of every p is global); p = 0: every layer slides."""
    return tuple(
        "sliding" if period == 0 or i % period < period - 1 else "full" for i in range(layers)
    )


def _gemma(
    meta: _Meta, family: str, hidden: int, heads: int, head_dim: int, layers: int
) -> dict[str, float | None]:
    """Gemma's query scale and logit soft-caps (ModelArch fields); Nones for other families."""
    if not FAMILIES[family].sandwich_norms:
        return {"query_scale": None, "attn_softcap": None, "final_softcap": None}
    scalar = hidden // heads if layers == _GEMMA_27B_LAYERS[meta.arch] else head_dim
    defaults = (50.0, 30.0) if meta.arch == "gemma2" else (None, None)  # llama.cpp's
    attn = meta.get("attn_logit_softcapping", defaults[0])
    final = meta.get("final_logit_softcapping", defaults[1])
    return {
        "query_scale": float(scalar) ** -0.5,
        "attn_softcap": None if attn is None else float(attn),
        "final_softcap": None if final is None else float(final),
    }


def _moe(meta: _Meta, family: str) -> MoeArch | None:
    """The experts of {arch}.expert_count / expert_used_count; None for a dense model."""
    experts = meta.get("expert_count")
    if not experts:
        if family == "qwen3_moe":
            raise ValueError(f"{meta.path}: metadata key {meta.arch}.expert_count is missing.")
        return None
    used = meta.int("expert_used_count", 0)
    if not 1 <= used <= experts:
        raise meta.refuse("expert_used_count", used, f"must be in [1, expert_count={experts}]")
    for key, fine, what in (
        ("expert_shared_count", (0,), "shared experts"),
        ("expert_gating_func", (_GATING_SOFTMAX,), "routing here is a softmax"),
        ("expert_weights_scale", (0.0, 1.0), "routing weights are not scaled here"),
        ("leading_dense_block_count", (0,), "every layer's MLP is the experts here"),
    ):
        value = meta.get(key, fine[0])
        if value not in fine:
            raise meta.refuse(key, value, what)
    n_ff = meta.int("feed_forward_length")
    size = meta.get("expert_feed_forward_length") or (
        n_ff // used if family == "qwen3_moe" else n_ff
    )
    norm = bool(meta.get("expert_weights_norm", True))
    return MoeArch(int(experts), used, norm, int(size))
