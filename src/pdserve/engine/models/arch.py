"""Architecture hyper-parameters of a Llama-family model, whatever file the weights come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MoeArch:
    """A sparse mixture-of-experts MLP (engine/models/moe.py) in place of the dense one."""

    num_experts: int
    top_k: int  # experts each token runs
    # Renormalise the chosen k routing weights to sum to 1 (Mixtral always does; Qwen3-MoE's
    # norm_topk_prob); False keeps the softmax's own values.
    norm_topk_prob: bool = True


@dataclass(frozen=True)
class ModelArch:
    """What the model code needs to build a Llama/SmolLM2/Qwen2/Mistral decoder.

    Filled from a HF `config.json` or from GGUF metadata by `engine.loader`.
    """

    architecture: str  # "llama" | "qwen2" | "mistral" | "mixtral" (one implementation)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # llama3-style scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None means plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has bias on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""
    # Set: every layer's MLP is a mixture of `intermediate_size`-wide experts (Mixtral).
    moe: MoeArch | None = None

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
