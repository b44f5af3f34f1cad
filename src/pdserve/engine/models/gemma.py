"""Gemma 2 and Gemma 3: the Llama layer with "sandwich" norms.

Everything else Gemma does is a Family flag or a ModelArch value the shared code reads:
(1 + w) norms (folded into w at load, models/checkpoint.py), embeddings scaled by
sqrt(hidden), the GELU-tanh MLP, query_pre_attn_scalar, attention and final logit soft-caps,
sliding-window layers interleaved with global ones, q/k head norms and a second RoPE base
for the sliding layers (Gemma 3).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.attention import AttentionMetadata
from pdserve.engine.models.llama import LlamaLayer


class GemmaLayer(LlamaLayer):
    """x += norm(attn(norm(x))); x += norm(mlp(norm(x))): each sublayer's output is normed
    before it joins the residual stream, so the residual is added here, not in the projection.
    Gemma has no bfloat16 prompt-weights path (forward_prompt): its projections still run the
    prefill format where one is attached, through `project`."""

    def __init__(self, arch: ModelArch, index: int) -> None:
        super().__init__(arch, index)
        self.attn_out_norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.mlp_out_norm = nn.Parameter(torch.ones(arch.hidden_size))

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.project("qkv", self.rms_norm(x, self.input_norm))
        attn = self.attention(qkv, cos, sin, kv, meta).reshape(x.shape[0], self.q_size)
        x = x + self.rms_norm(self.project("o", attn), self.attn_out_norm)
        mlp = self.project("down", self.activation(self.rms_norm(x, self.post_norm)))
        return x + self.rms_norm(mlp, self.mlp_out_norm)


def layer_class(arch: ModelArch) -> type[LlamaLayer]:
    """The decoder layer an architecture builds."""
    return GemmaLayer if arch.family.sandwich_norms else LlamaLayer
