"""Architecture hyper-parameters of a decoder model, whatever file the weights come from.

Two layers of description:
  * `Family`: what an architecture does differently from Llama, fixed by the architecture
    (Qwen3 always normalises q and k heads; Gemma always scales its embeddings);
  * `ModelArch`: one model's sizes and the values its config sets (windows, soft-caps).
The model code asks these, never `architecture == "..."`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kv_layout import KVLayout


@dataclass(frozen=True)
class Family:
    """How one architecture departs from the Llama decoder layer."""

    qkv_bias: bool = False  # bias on q/k/v (Qwen2), whatever the config says
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    # Gemma: RMSNorm scales by (1 + w); folded into w as the weights load.
    norm_offset: float = 0.0
    # Gemma: norms on the attention and MLP outputs too, before each joins the residual.
    sandwich_norms: bool = False
    scaled_embedding: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    fused_checkpoint: bool = False  # Phi-3: qkv_proj and gate_up_proj stored fused


_GEMMA = dict(norm_offset=1.0, sandwich_norms=True, scaled_embedding=True)
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "mixtral": Family(),  # Mistral's attention, a mixture of experts (models/moe.py)
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    "qwen3_moe": Family(qk_norm=True),  # Qwen3's attention, a mixture of experts (models/moe.py)
    "phi3": Family(fused_checkpoint=True),
    "gemma2": Family(**_GEMMA),  # type: ignore[arg-type]
    "gemma3": Family(qk_norm=True, **_GEMMA),  # type: ignore[arg-type]
}

HIDDEN_ACTS = ("silu", "gelu_tanh")  # the MLP's act(gate) * up


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer's attention scores are formed and which keys a query sees."""

    scale: float | None = None  # softmax scale; None: 1 / sqrt(head_dim)
    # A query at position p sees keys (p - window, p] (itself and window - 1 before it);
    # None: every earlier key.
    window: int | None = None
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)

    def cuts(self, context: int) -> bool:
        """Does the window hide any key from a query among `context` tokens?"""
        return self.window is not None and context > self.window

    def scale_for(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)


@dataclass(frozen=True)
class MoeArch:
    """A sparse mixture-of-experts MLP (engine/models/moe.py) in place of the dense one."""

    num_experts: int
    top_k: int  # experts each token runs
    # Renormalise the chosen k routing weights to sum to 1 (Mixtral always does; Qwen3-MoE's
    # norm_topk_prob); False keeps the softmax's own values.
    norm_topk_prob: bool
    expert_size: int  # each expert's intermediate width (Qwen3-MoE's moe_intermediate_size)
    # Layers whose MLP stays dense, `intermediate_size` wide (Qwen3-MoE's mlp_only_layers and
    # decoder_sparse_step); every other layer's MLP is the experts.
    dense_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelArch:
    """What the model code needs to build a decoder of one of `FAMILIES`.

    Filled from a HF `config.json` (engine/models/hf_config.py) or from GGUF metadata by
    `engine.loader`.
    """

    architecture: str  # a key of FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} or {"rope_type": "linear", "factor"}; None: plain.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has bias on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""
    # Set: the MLP of every layer but moe.dense_layers is a mixture of experts (Mixtral,
    # Qwen3-MoE); `moe_at` says which.
    moe: MoeArch | None = None
    hidden_act: str = "silu"  # one of HIDDEN_ACTS
    sliding_window: int | None = None  # the window of the "sliding" layers
    layer_types: tuple[str, ...] = ()  # "sliding" | "full" per layer; (): all full
    local_rope_theta: float | None = None  # RoPE base of sliding layers (Gemma 3); None: same
    query_scale: float | None = None  # softmax scale (Gemma's query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # attention logit soft-cap (Gemma 2)
    final_softcap: float | None = None  # final logit soft-cap (Gemma 2/3)

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    def moe_at(self, layer: int) -> MoeArch | None:
        """The experts of `layer`'s MLP; None: a dense MLP."""
        if self.moe is None or layer in self.moe.dense_layers:
            return None
        return self.moe

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    def attention(self, layer: int) -> AttentionSpec:
        window = self.sliding_window if self.is_sliding(layer) else None
        return AttentionSpec(self.query_scale, window, self.attn_softcap)

    def kv_layout(self, dtype: torch.dtype) -> KVLayout:
        """The KV this model computes, held in `dtype`."""
        kinds = "".join("s" if self.is_sliding(i) else "f" for i in range(self.num_layers))
        if not (self.sliding_window and "s" in kinds):  # no window, or one no layer uses
            return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, dtype)
        return KVLayout(
            self.num_layers, self.num_kv_heads, self.head_dim, dtype, self.sliding_window, kinds
        )

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer is a sliding one (Mistral): the paged KV cache may then
        free whole blocks that leave it (engine/kv_cache_manager.py). None when some layer sees
        every key (Gemma's global layers keep the whole context, so the shared block table
        does too)."""
        if (
            self.sliding_window
            and self.layer_types
            and all(t == "sliding" for t in self.layer_types)
        ):
            return self.sliding_window
        return None

    def kv_needed_from(self, layer: int, num_tokens: int) -> int:
        """The first of `num_tokens` cached tokens whose KV this layer reads when the next token
        is computed: the window's first key on a sliding layer, 0 on a full one. The P -> D
        hand-off sends each layer its KV from here on (workers/prefill.py, decode.py)."""
        window = self.attention(layer).window
        return 0 if window is None else max(0, num_tokens - window + 1)

    def kv_complete_from(self, num_tokens: int) -> int:
        """The first token whose KV the hand-off sends for every layer."""
        return max((self.kv_needed_from(i, num_tokens) for i in range(self.num_layers)), default=0)

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
