"""The Llama decoder (Llama, SmolLM2, Qwen2/2.5 with q/k/v bias, Qwen3 with q/k head norms,
Mistral, Phi-3; Mixtral and Qwen3-MoE with models/moe.py's experts) over a paged KV cache;
Gemma 2/3 (models/gemma.py) subclass its layer.

What an architecture changes is read from its `Family` and `ModelArch` (models/arch.py), never
from its name: q/k head norms, the MLP's activation, each layer's attention (scale, sliding
window, soft-cap: models/attention.py, which holds the step's batch layout too), a second RoPE
base for sliding layers, scaled embeddings and soft-capped final logits.
The LM head runs only on the positions that are sampled.
Weights are fused per layer (q|k|v and gate|up) so each layer issues four matmuls, and stored
transposed, [in, out], because MKL's `x @ W` runs up to 2x faster than `x @ W.T` when x has few
rows (decode batches), and no slower for prompts.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.linear.base import FusedOps, Projection
from pdserve.engine.models import checkpoint
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.attention import AttentionMetadata, paged_attention
from pdserve.engine.models.moe import SparseMoe
from pdserve.engine.models.rope import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from collections.abc import Callable

    from pdserve.engine.linear.phases import PromptWeights, StepRows

# cos, sin of one RoPE table for this step's positions ([T, 1, D] each)
CosSin = tuple[torch.Tensor, ...]


class LlamaLayer(nn.Module):
    def __init__(self, arch: ModelArch, index: int) -> None:
        super().__init__()
        self.index = index
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.q_size, self.kv_size = arch.num_heads * d, arch.num_kv_heads * d
        self.eps = arch.rms_norm_eps
        self.intermediate_size = arch.intermediate_size
        self.act = arch.hidden_act
        self.spec = arch.attention(index)  # scale, sliding window, soft-cap
        # Sliding layers of Gemma 3 rotate with their own RoPE base (LlamaModel.forward).
        self.local_rope = arch.is_sliding(index) and arch.local_rope_theta is not None
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_norm = nn.Parameter(torch.ones(h))  # before the MLP
        # Projection weights are [in, out]: transposed w.r.t. HF / nn.Linear.
        self.qkv = nn.Parameter(torch.empty(h, self.q_size + 2 * self.kv_size))
        self.qkv_bias = (
            nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size))
            if arch.attention_bias
            else None
        )
        # RMSNorm weights [D] of every q head and every k head (Qwen3, Gemma 3).
        self.q_norm = nn.Parameter(torch.ones(d)) if arch.family.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(d)) if arch.family.qk_norm else None
        self.o = nn.Parameter(torch.empty(self.q_size, h))
        # The MLP: this layer's experts, or a dense one.
        self.moe = SparseMoe(arch) if arch.moe_at(index) is not None else None
        if self.moe is None:
            self.gate_up = nn.Parameter(torch.empty(h, 2 * arch.intermediate_size))
            self.down = nn.Parameter(torch.empty(arch.intermediate_size, h))
        # Quantized stand-ins for the projections above, by name (quantize.quantize_model); a
        # projection not listed here runs on its float weight.
        self.quantized: dict[str, Projection] = {}
        # Native RMSNorm / RoPE / silu * up (linear.base.FusedOps), set for quantized (w8g32, w8a8,
        # gguf, gguf-a8, gguf-a16) models; None: torch's ops.
        self.fused: FusedOps | None = None
        # The prefill format's bfloat16 projections (engine/prefill_format.py), when loaded.
        self.prompt_weights: PromptWeights | None = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        prompt = self.prompt_weights
        if prompt is not None and prompt.active:
            return self.forward_prompt(prompt, x, cos, sin, kv, meta)
        attn = self.attention(
            self.project("qkv", self.rms_norm(x, self.input_norm)), cos, sin, kv, meta
        )
        x = self.project("o", attn.reshape(x.shape[0], self.q_size), residual=x)
        if self.moe is not None:
            return self.moe.forward(self.rms_norm(x, self.post_norm), residual=x)
        return self.project("down", self.activation(self.rms_norm(x, self.post_norm)), residual=x)

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """act(gate) * up for the MLP's normed input h: [T, intermediate]."""
        n = self.intermediate_size
        if self.act == "gelu_tanh":
            gate_up = self.project("gate_up", h)
            return F.gelu(gate_up[:, :n], approximate="tanh").mul_(gate_up[:, n:])
        fused_act = getattr(self.quantized.get("gate_up"), "silu_mul", None)
        act = fused_act(h) if fused_act is not None else None  # bf16x3: in the GEMM's store
        if act is not None:
            return act
        gate_up = self.project("gate_up", h)
        if self.fused is not None:
            return self.fused.silu_mul(gate_up, n)
        # Slices and an in-place product: chunk() and a fresh product tensor cost ~10 us a
        # layer at decode sizes, for no arithmetic (the same values bit for bit).
        return F.silu(gate_up[:, :n]).mul_(gate_up[:, n:])

    def forward_prompt(
        self,
        w: PromptWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The layer for a step of prompt rows only, on the prefill format: norms write the
        GEMMs' bfloat16 inputs, the MLP stays bfloat16 between its GEMMs, and the residual
        stream, RoPE and the KV stay float32 (kernels/bf16.cpp)."""
        p, ops = w.linears, w.ops
        qkv = p["qkv"](ops.rms_norm(x, self.input_norm, self.eps))
        attn = self.attention(qkv, cos, sin, kv, meta)
        x = p["o"](attn.reshape(x.shape[0], self.q_size), residual=x)
        gate_up = p["gate_up"].gemm(ops.rms_norm(x, self.post_norm, self.eps))
        return p["down"](ops.silu_mul(gate_up, self.intermediate_size), residual=x)

    def attention(
        self,
        qkv: torch.Tensor,  # [T, q + 2 kv] float32: the fused projection's output
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """RoPE, the KV write and attention ([T, H, D]); the layer hook sees this layer's KV."""
        t, heads = qkv.shape[0], self.num_heads + self.num_kv_heads
        if self.q_norm is not None:  # per-head norms, then RoPE on the normed heads
            qkv = torch.cat((self.norm_heads(qkv, heads).view(t, -1), qkv[:, -self.kv_size :]), 1)
        # RoPE once over q and k together (they are adjacent in the fused output): half the ops.
        if self.fused is not None:
            qk = self.fused.rope(qkv, heads, cos, sin)
        else:
            qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(t, heads, -1), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        attn = paged_attention(q, k, v, kv, meta, self.spec)  # [T, H, D]
        if meta.layer_hook is not None:
            meta.layer_hook(self.index, k, v)
        return attn

    def norm_heads(self, qkv: torch.Tensor, heads: int) -> torch.Tensor:
        """RMSNorm of each q and k head over head_dim: [T, heads, D]."""
        assert self.q_norm is not None and self.k_norm is not None
        qk = qkv[:, : self.q_size + self.kv_size].reshape(qkv.shape[0], heads, self.head_dim)
        weight = torch.cat(
            (self.q_norm.expand(self.num_heads, -1), self.k_norm.expand(self.num_kv_heads, -1))
        )
        return F.rms_norm(qk, (self.head_dim,), None, self.eps) * weight

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(x, weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def project(
        self, name: str, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ W (+ bias) (+ residual) for the projection `name`: quantized (or tiled) if it
        was, else in float. The residual is added last, as `residual + x @ W` (bit for bit:
        the native kernels add it as they store, saving an op and a tensor a projection)."""
        quantized = self.quantized.get(name)
        if quantized is not None:
            return quantized(x, residual)
        weight = getattr(self, name)
        if name == "qkv" and self.qkv_bias is not None:
            y = torch.addmm(self.qkv_bias, x, weight)
        else:
            y = x @ weight
        return y if residual is None else residual + y


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, layer: type[LlamaLayer] = LlamaLayer) -> None:
        super().__init__()
        self.arch = arch
        self.embed = nn.Parameter(torch.empty(arch.vocab_size, arch.hidden_size))
        self.layers = nn.ModuleList(layer(arch, i) for i in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size))
        # [hidden, vocab]: a transposed copy even when tied (the lookup needs rows of `embed`).
        self.lm_head = nn.Parameter(torch.empty(arch.hidden_size, arch.vocab_size))
        # The global RoPE, and the sliding layers' own (Gemma 3) when the arch has one.
        self.ropes: list[RotaryEmbedding] = []
        self.quantized_head: Projection | None = None  # set by quantize.quantize_model
        self.fused: FusedOps | None = None  # native RMSNorm / RoPE, set by quantize.quantize_model
        # Set when prompt rows run on a prefill format (engine/prefill_format.py `attach`).
        self.step_rows: StepRows | None = None
        # Prompt rows' causal attention in a step that leaves them on the decode format
        # (prefill_format.decode_rows_attention); None: SDPA.
        self.decode_rows_attention: Callable[..., torch.Tensor] | None = None
        # time.monotonic() when a layer last finished: a worker's heartbeat reports it, so a
        # step that runs for minutes (a big model's long prompt) reads as busy, not stuck.
        self.layer_done_at = 0.0

    def _make_ropes(self) -> list[RotaryEmbedding]:
        a, dev = self.arch, self.embed.device
        ropes = [RotaryEmbedding(a.head_dim, a.rope_theta, a.rope_scaling, dev)]
        if a.local_rope_theta is not None:
            ropes.append(RotaryEmbedding(a.head_dim, a.local_rope_theta, None, dev))
        return ropes

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Returns logits [S, vocab] for `meta.sample_rows` (float32)."""
        if not self.ropes:
            self.ropes = self._make_ropes()
        if self.step_rows is not None and self.step_rows.set(
            len(input_ids), meta.num_decodes if meta.decode_rows is None else meta.decode_rows
        ):
            for m in (meta, meta.sliding):
                if m is not None:
                    m.prompt_dtype = self.step_rows.prompt_dtype
                    m.prompt_attention = self.step_rows.prompt_attention
        elif self.decode_rows_attention is not None and meta.prefills:
            for m in (meta, meta.sliding):
                if m is not None:
                    m.prompt_attention = self.decode_rows_attention
        x = F.embedding(input_ids, self.embed)
        if self.arch.family.scaled_embedding:  # Gemma: sqrt(hidden) rounded to x's dtype first
            x = x * torch.tensor(self.arch.hidden_size**0.5, dtype=x.dtype)
        tables = [rope.cos_sin(meta.positions, x.dtype) for rope in self.ropes]
        # layer.forward, not layer(...): nn.Module's call machinery (hooks, tracing checks)
        # costs ~10 us a layer a step, and nothing here registers hooks.
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            cos, sin = tables[1 if layer.local_rope else 0]
            x = layer.forward(x, cos, sin, kv, meta.for_layer(self.arch.is_sliding(i)))
            self.layer_done_at = time.monotonic()
        if meta.sample_rows is not None:
            x = x[meta.sample_rows]
        eps = self.arch.rms_norm_eps
        if self.fused is not None:
            x = self.fused.rms_norm(x, self.norm, eps)
        else:
            x = F.rms_norm(x, (x.shape[-1],), self.norm, eps)
        head = self.quantized_head
        logits = (x @ self.lm_head if head is None else head(x)).float()
        cap = self.arch.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the fused parameters; every parameter must be filled."""
        checkpoint.fill(self, self.arch, weights)
