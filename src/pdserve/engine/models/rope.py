"""Rotary position embeddings in the HF (rotate-half) layout, with llama3 or linear scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


class RotaryEmbedding:
    """cos / sin tables for one RoPE base and scaling (a model with two, Gemma 3, holds two)."""

    def __init__(
        self, head_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device
    ) -> None:
        dim = head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = scaling or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            inv_freq = _llama3_scale(inv_freq, scaling)
        elif kind == "linear":  # positions divided by the factor (Gemma 3's global layers)
            inv_freq = inv_freq / scaling["factor"]
        elif kind not in (None, "default"):  # hf_config refuses these; never rotate wrongly
            raise ValueError(f"RoPE scaling {kind!r} is not supported")
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos [T, 1, D] and the signed sin [T, 1, D] (-sin | sin) that `apply_rope` takes.

        Built once per step and shared by every layer."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        signed_sin = torch.cat((-sin, sin), dim=-1)
        return torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :], signed_sin.to(dtype)[:, None]


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin, bit for bit: rotate_half(x) * sin equals
    roll(x, D/2) * (-sin | sin), one op instead of a slice, a negation and a concatenation."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
