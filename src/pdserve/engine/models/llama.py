"""The Llama family (Llama, SmolLM2, Qwen2, Mistral, Mixtral's experts) over a paged KV cache.

One step runs a flat batch of T tokens from several requests (no padding of the token axis):
  * decode requests (one query token each) come first and share one batched attention call;
  * prompt chunks follow, each attending to its cached prefix plus itself (causal).
K and V are written into the paged cache before attention, so a chunk reads its own keys back
from the same place a later step will. The LM head runs only on the positions that are sampled.
Weights are fused per layer (q|k|v and gate|up) so each layer issues four matmuls, and stored
transposed, [in, out], because MKL's `x @ W` runs up to 2x faster than `x @ W.T` when x has few
rows (decode batches), and no slower for prompts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.linear.base import FusedOps, Projection
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.moe import SparseMoe

if TYPE_CHECKING:
    from pdserve.engine.prefill_format import PromptWeights, StepRows


@dataclass
class PrefillSegment:
    start: int  # first row of this chunk in the flat batch
    length: int  # tokens in this chunk
    start_pos: int  # tokens of this request already in the cache before the step
    block_ids: torch.Tensor  # [num_blocks] long: the request's block table
    paged: bool = False  # computed by the in-place kernel (see PagedPlan)


@dataclass
class PagedPlan:
    """What the in-place paged kernel computes this step (built once per step, used by every layer).

    Rows in no tile (fresh prompt chunks, long chunks) are computed by SDPA instead.
    """

    tables: torch.Tensor  # [S, W] int32: block tables of the sequences the kernel reads
    tiles: torch.Tensor  # [M, 3] int32: (sequence, first row, rows <= 16)
    limits: torch.Tensor  # [T] int32: keys visible to each row (0 for rows in no tile)
    kernel: Callable[..., torch.Tensor]  # pdserve.engine.kernels: paged_attention(...)
    split_tokens: int = 512  # key-range split per work item (flash-decoding)
    # The kernel writes the step's K/V into the cache itself (its slots / k / v arguments:
    # float32 rows into a float32 or float16 cache) in the same call; False: torch's ops.
    writes_kv: bool = False


# Queries per SDPA call for a prompt chunk over a cached prefix (_prefill_attention). Measured
# on AMD EPYC Zen 4, one thread, 1904 queries behind a 96-token prefix, per layer: one call
# 149.8 ms, pieces of 128 / 256 / 512 queries 100.7 / 82.6 / 108.7 ms (a fresh 2000-token
# prompt: 77-80 ms with is_causal); docs/benchmarks/engine.md.
PREFIX_PIECE = 256


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset for each token
    num_decodes: int = 0  # rows [0, num_decodes) are single-token decodes
    decode_block_table: torch.Tensor | None = None  # [B, max_blocks] long, padded with 0
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSegment] = field(default_factory=list)
    # Set: decodes and the prefill segments with `paged=True` use the in-place kernel
    # (`--attention paged`); unset: every row gathers its blocks (`--attention gather`).
    paged: PagedPlan | None = None
    sample_rows: torch.Tensor | None = None  # [S] long: rows whose logits are needed
    # Called after each layer as hook(layer, k, v), k/v [T, KVH, D] as cached (after RoPE):
    # lets a prefill worker stream a layer's KV while the next layer computes.
    layer_hook: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
    # Prompt rows run on the prefill format this step (engine/prefill_format.py): their SDPA
    # (fresh chunks and long chunks over a cached prefix) computes in this dtype.
    prompt_dtype: torch.dtype | None = None
    # Or a kernel for prompt chunks' causal attention (bf16x3: kernels/amx.cpp), called as
    # (q [n, H, D], k, v [ctx, KVH, D], scale) -> [n, H, D] float32; None: SDPA.
    prompt_attention: Callable[..., torch.Tensor] | None = None


class RotaryEmbedding:
    """RoPE in the HF (rotate-half) layout, with optional llama3-style frequency scaling."""

    def __init__(self, arch: ModelArch, device: torch.device) -> None:
        dim = arch.head_dim
        inv_freq = 1.0 / (
            arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        scaling = arch.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "llama3":
            inv_freq = _llama3_scale(inv_freq, scaling)
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


class LlamaLayer(nn.Module):
    def __init__(self, arch: ModelArch, index: int) -> None:
        super().__init__()
        self.index = index
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.q_size, self.kv_size = arch.num_heads * d, arch.num_kv_heads * d
        self.eps = arch.rms_norm_eps
        self.intermediate_size = arch.intermediate_size
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_norm = nn.Parameter(torch.ones(h))
        # Projection weights are [in, out]: transposed w.r.t. HF / nn.Linear.
        self.qkv = nn.Parameter(torch.empty(h, self.q_size + 2 * self.kv_size))
        self.qkv_bias = (
            nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size))
            if arch.attention_bias
            else None
        )
        self.o = nn.Parameter(torch.empty(self.q_size, h))
        self.moe = SparseMoe(arch) if arch.moe is not None else None  # the MLP: the experts,
        if self.moe is None:  # or a dense one
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
        h = self.rms_norm(x, self.post_norm)
        if self.moe is not None:
            return self.moe.forward(h, residual=x)
        fused_act = getattr(self.quantized.get("gate_up"), "silu_mul", None)
        act = fused_act(h) if fused_act is not None else None  # bf16x3: in the GEMM's store
        if act is not None:
            return self.project("down", act, residual=x)
        gate_up = self.project("gate_up", h)
        if self.fused is not None:
            act = self.fused.silu_mul(gate_up, self.intermediate_size)
        else:
            # Slices and an in-place product: chunk() and a fresh product tensor cost ~10 us a
            # layer at decode sizes, for no arithmetic (the same values bit for bit).
            act = F.silu(gate_up[:, : self.intermediate_size])
            act.mul_(gate_up[:, self.intermediate_size :])
        return self.project("down", act, residual=x)

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
        # RoPE once over q and k together (they are adjacent in the fused output): half the ops.
        if self.fused is not None:
            qk = self.fused.rope(qkv, heads, cos, sin)
        else:
            qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(t, heads, -1), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        attn = paged_attention(q, k, v, kv, meta)  # [T, H, D]
        if meta.layer_hook is not None:
            meta.layer_hook(self.index, k, v)
        return attn

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


# Cache dtypes the native write_kv stores float32 rows into (the same values as torch's .to).
_NATIVE_KV_WRITES = (torch.float32, torch.float16)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    kv: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, KVH, D]
    meta: AttentionMetadata,
) -> torch.Tensor:
    k_cache, v_cache = kv
    plan = meta.paged
    native = k.dtype == torch.float32 and k_cache.dtype in _NATIVE_KV_WRITES
    if plan is not None and plan.writes_kv and native:
        return _paged_kernel_attention(q, k, v, k_cache, v_cache, meta, plan, write=True)
    kvh, d = k.shape[1], k.shape[2]
    # .to: a --kv-cache-dtype narrower than the model's rounds here, once per token.
    k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    if plan is not None:
        return _paged_kernel_attention(q, k, v, k_cache, v_cache, meta, plan)
    return gather_attention(q, k, v, k_cache, v_cache, meta)


def _paged_kernel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    plan: PagedPlan,
    write: bool = False,
) -> torch.Tensor:
    """Decodes and short cached-prefix chunks read the blocks in place; the rest use SDPA.
    `write`: the kernel first writes this step's K/V (k, v at meta.slot_mapping)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    args = (q, k_cache, v_cache, plan.tables, plan.tiles, plan.limits, plan.split_tokens, scale)
    # [T, H, D]; rows outside the plan's tiles are filled below
    out = plan.kernel(*args, meta.slot_mapping, k, v) if write else plan.kernel(*args)
    for seg in meta.prefills:
        if not seg.paged:
            rows = slice(seg.start, seg.start + seg.length)
            out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, seg, meta)
    return out


def gather_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], this step's K already written
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """The reference path: copy every block a row reads into a new tensor, then SDPA.

    `--attention gather`, the CUDA path, and the oracle the paged kernel is tested against.
    """
    if meta.num_decodes == q.shape[0]:  # a pure decode step: no output buffer to fill
        return _decode_attention(q, k_cache, v_cache, meta)
    out = torch.empty_like(q)
    if meta.num_decodes:
        b = meta.num_decodes
        out[:b] = _decode_attention(q[:b], k_cache, v_cache, meta)
    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.length)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, seg, meta)
    return out


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    assert meta.decode_block_table is not None and meta.decode_mask is not None
    table = meta.decode_block_table
    b, kvh, d = table.shape[0], k_cache.shape[2], k_cache.shape[3]
    # index_select copies whole blocks (memcpy rows); advanced indexing is ~30% slower.
    flat = table.flatten()
    keys = k_cache.index_select(0, flat).view(b, -1, kvh, d).transpose(1, 2)  # [B, KVH, L, D]
    values = v_cache.index_select(0, flat).view(b, -1, kvh, d).transpose(1, 2)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a narrower --kv-cache-dtype
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, enable_gqa=True
    )  # [B, H, 1, D]
    return o.squeeze(2)


def _prefill_attention(
    q: torch.Tensor,  # [n, H, D]
    k: torch.Tensor,  # [n, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: PrefillSegment,
    meta: AttentionMetadata | None = None,
) -> torch.Tensor:
    """[n, H, D] in q's dtype; computed in meta.prompt_dtype when set (torch's flash SDPA in
    bfloat16 blocks the scores and runs its GEMMs on the matrix units)."""
    kernel = meta.prompt_attention if meta is not None else None
    if kernel is not None and q.shape[-1] == 64:
        if seg.start_pos:  # the cached prefix and the chunk's own K/V, as cached
            ctx, (kvh, d) = seg.start_pos + seg.length, k_cache.shape[2:]
            k = k_cache.index_select(0, seg.block_ids).view(-1, kvh, d)[:ctx].float()
            v = v_cache.index_select(0, seg.block_ids).view(-1, kvh, d)[:ctx].float()
        return kernel(q, k, v, 1.0 / math.sqrt(q.shape[-1]))
    dtype = (meta.prompt_dtype if meta is not None else None) or q.dtype
    if dtype != q.dtype:
        return _prefill_attention_as(dtype, q, k, v, k_cache, v_cache, seg)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if seg.start_pos == 0:  # nothing cached: attend within the chunk only
        o = F.scaled_dot_product_attention(
            qh,
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)
    ctx = seg.start_pos + seg.length
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    keys = k_cache.index_select(0, seg.block_ids).view(-1, kvh, d)[:ctx].transpose(0, 1)[None]
    values = v_cache.index_select(0, seg.block_ids).view(-1, kvh, d)[:ctx].transpose(0, 1)[None]
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a narrower --kv-cache-dtype
    # A masked SDPA computes every query against every key it is given: one call for the whole
    # chunk would spend half its work on the masked upper triangle (a 1904-token chunk behind a
    # 96-token prefix hit took 1.9x a fresh 2000-token prompt). Pieces of PREFIX_PIECE queries
    # each take only the keys up to their last position.
    out = torch.empty_like(qh)
    for a in range(0, seg.length, PREFIX_PIECE):
        b = min(seg.length, a + PREFIX_PIECE)
        end = seg.start_pos + b
        q_pos = torch.arange(seg.start_pos + a, end, device=q.device)
        mask = torch.arange(end, device=q.device)[None, :] <= q_pos[:, None]  # [b - a, end]
        out[:, :, a:b] = F.scaled_dot_product_attention(
            qh[:, :, a:b], keys[:, :, :end], values[:, :, :end], attn_mask=mask, enable_gqa=True
        )
    return out.squeeze(0).transpose(0, 1)


def _prefill_attention_as(
    dtype: torch.dtype,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: PrefillSegment,
) -> torch.Tensor:
    """_prefill_attention on q, k, v (and the cached prefix) rounded to `dtype`; back in q's."""
    kc, vc = k_cache, v_cache
    if seg.start_pos:  # the prefix read in `dtype` too (a float16 cache: one rounding)
        kc = k_cache.index_select(0, seg.block_ids).to(dtype)
        vc = v_cache.index_select(0, seg.block_ids).to(dtype)
        seg = PrefillSegment(seg.start, seg.length, seg.start_pos, torch.arange(len(kc)))
    return _prefill_attention(q.to(dtype), k.to(dtype), v.to(dtype), kc, vc, seg).to(q.dtype)


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.embed = nn.Parameter(torch.empty(arch.vocab_size, arch.hidden_size))
        self.layers = nn.ModuleList(LlamaLayer(arch, i) for i in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size))
        # [hidden, vocab]: a transposed copy even when tied (the lookup needs rows of `embed`).
        self.lm_head = nn.Parameter(torch.empty(arch.hidden_size, arch.vocab_size))
        self.rope: RotaryEmbedding | None = None
        self.quantized_head: Projection | None = None  # set by quantize.quantize_model
        self.fused: FusedOps | None = None  # native RMSNorm / RoPE, set by quantize.quantize_model
        # Set when prompt rows run on a prefill format (engine/prefill_format.py `attach`).
        self.step_rows: StepRows | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Returns logits [S, vocab] for `meta.sample_rows` (float32)."""
        if self.rope is None:
            self.rope = RotaryEmbedding(self.arch, self.embed.device)
        if self.step_rows is not None and self.step_rows.set(len(input_ids), meta.num_decodes):
            meta.prompt_dtype = self.step_rows.prompt_dtype
            meta.prompt_attention = self.step_rows.prompt_attention
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rope.cos_sin(meta.positions, x.dtype)
        # layer.forward, not layer(...): nn.Module's call machinery (hooks, tracing checks)
        # costs ~10 us a layer a step, and nothing here registers hooks.
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer.forward(x, cos, sin, kv, meta)
        if meta.sample_rows is not None:
            x = x[meta.sample_rows]
        eps = self.arch.rms_norm_eps
        if self.fused is not None:
            x = self.fused.rms_norm(x, self.norm, eps)
        else:
            x = F.rms_norm(x, (x.shape[-1],), self.norm, eps)
        head = self.quantized_head
        return (x @ self.lm_head if head is None else head(x)).float()

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the fused parameters; every parameter must be filled."""
        filled: set[str] = set()

        params = dict(self.named_parameters())

        def put(name: str, value: torch.Tensor, transpose: bool = False) -> None:
            value = value.t() if transpose else value
            if tuple(value.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"{name}: shape {tuple(value.shape)}, expected {tuple(params[name].shape)}"
                )
            params[name].data = value.to(params[name].dtype).contiguous()
            filled.add(name)

        put("embed", weights["model.embed_tokens.weight"])
        put("norm", weights["model.norm.weight"])
        tied = self.arch.tie_word_embeddings
        head = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]
        put("lm_head", head, transpose=True)
        for i in range(self.arch.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            put(f"layers.{i}.input_norm", weights[p + "input_layernorm.weight"])
            put(f"layers.{i}.post_norm", weights[p + "post_attention_layernorm.weight"])
            qkv = torch.cat([weights[a + f"{n}_proj.weight"] for n in "qkv"])
            put(f"layers.{i}.qkv", qkv, transpose=True)
            if self.arch.attention_bias:
                bias = torch.cat([weights[a + f"{n}_proj.bias"] for n in "qkv"])
                put(f"layers.{i}.qkv_bias", bias)
            put(f"layers.{i}.o", weights[a + "o_proj.weight"], transpose=True)
            if (moe := cast(LlamaLayer, self.layers[i]).moe) is not None:  # names: models/moe.py
                for name, value in moe.hf_weights(weights, p).items():
                    put(f"layers.{i}.moe.{name}", value)
                continue
            gate_up = torch.cat([weights[m + "gate_proj.weight"], weights[m + "up_proj.weight"]])
            put(f"layers.{i}.gate_up", gate_up, transpose=True)
            put(f"layers.{i}.down", weights[m + "down_proj.weight"], transpose=True)
        missing = {n for n, _ in self.named_parameters()} - filled
        if missing:
            raise ValueError(f"weights missing for parameters: {sorted(missing)[:5]}")
