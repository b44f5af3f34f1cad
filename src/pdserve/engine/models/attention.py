"""Attention over the paged KV cache: the step's metadata and every path a row can take.

One step runs a flat batch of T tokens from several requests (no padding of the token axis):
  * decode requests (one query token each) come first and share one batched attention call;
  * prompt chunks follow, each attending to its cached prefix plus itself (causal).
K and V are written into the paged cache before attention, so a chunk reads its own keys back
from the same place a later step will.

Each layer passes its AttentionSpec (models/arch.py): the softmax scale, a sliding window and
a logit soft-cap. Every path applies all three: the native paged kernel (decodes, short chunks
over a cached prefix), SDPA on gathered blocks (`--attention gather`), fresh and long prompt
chunks (SDPA, or an explicit softmax where scores are soft-capped, which SDPA cannot do), and
the prefill formats' bfloat16 SDPA; bf16x3's AMX causal kernel only takes plain causal
attention, so a chunk that a window cuts or a soft-capped layer runs SDPA instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.engine.models.arch import AttentionSpec

PLAIN = AttentionSpec()


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
    # rows [0, decode_rows) run on the decode weight format: the decodes and the verify chunks
    # after them (speculation: their logits must be the decode format's); None: num_decodes
    decode_rows: int | None = None
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
    # Decode masks narrowed to a window, by window (built by the first layer that needs one).
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # The sliding layers' own metadata when they hold their KV in their own blocks (a KV group,
    # engine/hybrid_kv.py): the same rows, their slots and block tables. None: one group.
    sliding: AttentionMetadata | None = None

    def for_layer(self, sliding: bool) -> AttentionMetadata:
        """What a layer reads and writes through (`sliding`: a sliding-window layer)."""
        return self.sliding if sliding and self.sliding is not None else self


# Cache dtypes the native write_kv stores float32 rows into (the same values as torch's .to).
_NATIVE_KV_WRITES = (torch.float32, torch.float16)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    kv: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, KVH, D]
    meta: AttentionMetadata,
    spec: AttentionSpec = PLAIN,
) -> torch.Tensor:
    k_cache, v_cache = kv
    plan = meta.paged
    native = k.dtype == torch.float32 and k_cache.dtype in _NATIVE_KV_WRITES
    if plan is not None and plan.writes_kv and native:
        return _paged_kernel_attention(q, k, v, k_cache, v_cache, meta, plan, spec, write=True)
    kvh, d = k.shape[1], k.shape[2]
    # .to: a --kv-cache-dtype narrower than the model's rounds here, once per token.
    k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    if plan is not None:
        return _paged_kernel_attention(q, k, v, k_cache, v_cache, meta, plan, spec)
    return gather_attention(q, k, v, k_cache, v_cache, meta, spec)


def _paged_kernel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    plan: PagedPlan,
    spec: AttentionSpec,
    write: bool = False,
) -> torch.Tensor:
    """Decodes and short cached-prefix chunks read the blocks in place; the rest use SDPA.
    `write`: the kernel first writes this step's K/V (k, v at meta.slot_mapping)."""
    scale = spec.scale_for(q.shape[-1])
    args = (q, k_cache, v_cache, plan.tables, plan.tiles, plan.limits, plan.split_tokens, scale)
    kw = {}
    if spec.window is not None or spec.softcap is not None:  # plain calls keep the old signature
        kw = {"window": spec.window or -1, "softcap": spec.softcap or 0.0}
    # [T, H, D]; rows outside the plan's tiles are filled below
    out = plan.kernel(*args, meta.slot_mapping, k, v, **kw) if write else plan.kernel(*args, **kw)
    for seg in meta.prefills:
        if not seg.paged:
            rows = slice(seg.start, seg.start + seg.length)
            out[rows] = _prefill_attention(
                q[rows], k[rows], v[rows], k_cache, v_cache, seg, meta, spec
            )
    return out


def gather_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], this step's K already written
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    spec: AttentionSpec = PLAIN,
) -> torch.Tensor:
    """The reference path: copy every block a row reads into a new tensor, then SDPA.

    `--attention gather`, the CUDA path, and the oracle the paged kernel is tested against.
    """
    if meta.num_decodes == q.shape[0]:  # a pure decode step: no output buffer to fill
        return _decode_attention(q, k_cache, v_cache, meta, spec)
    out = torch.empty_like(q)
    if meta.num_decodes:
        b = meta.num_decodes
        out[:b] = _decode_attention(q[:b], k_cache, v_cache, meta, spec)
    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.length)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, seg, meta, spec)
    return out


def sdpa(
    q: torch.Tensor,  # [B, H, n, D]
    k: torch.Tensor,  # [B, KVH, L, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool, broadcast to [B, H, n, L]; True: visible
    spec: AttentionSpec,
    is_causal: bool = False,
) -> torch.Tensor:
    """torch's SDPA, or (soft-capped scores, which it has no hook for) the same explicitly."""
    if spec.softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=spec.scale, enable_gqa=True
        )
    assert mask is not None, "soft-capped attention takes an explicit mask"
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * spec.scale_for(q.shape[-1])
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    spec: AttentionSpec = PLAIN,
) -> torch.Tensor:
    assert meta.decode_block_table is not None and meta.decode_mask is not None
    table = meta.decode_block_table
    b, kvh, d = table.shape[0], k_cache.shape[2], k_cache.shape[3]
    # index_select copies whole blocks (memcpy rows); advanced indexing is ~30% slower.
    flat = table.flatten()
    keys = k_cache.index_select(0, flat).view(b, -1, kvh, d).transpose(1, 2)  # [B, KVH, L, D]
    values = v_cache.index_select(0, flat).view(b, -1, kvh, d).transpose(1, 2)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a narrower --kv-cache-dtype
    mask = _decode_mask(meta, spec.window)
    o = sdpa(q.unsqueeze(2), keys, values, mask, spec)  # [B, H, 1, D]
    return o.squeeze(2)


def _decode_mask(meta: AttentionMetadata, window: int | None) -> torch.Tensor:
    """[B, 1, 1, L] keys each decode row sees: its context, cut to its last `window` keys."""
    assert meta.decode_mask is not None
    if window is None:
        return meta.decode_mask
    mask = meta.window_masks.get(window)
    if mask is None:
        b, width = meta.decode_mask.shape[0], meta.decode_mask.shape[-1]
        first = meta.positions[:b] - window + 1  # [B]: the oldest key each row still sees
        keys = torch.arange(width, device=first.device)
        mask = meta.decode_mask & (keys[None, :] >= first[:, None])[:, None, None, :]
        meta.window_masks[window] = mask
    return mask


def _prefill_attention(
    q: torch.Tensor,  # [n, H, D]
    k: torch.Tensor,  # [n, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: PrefillSegment,
    meta: AttentionMetadata | None = None,
    spec: AttentionSpec = PLAIN,
) -> torch.Tensor:
    """[n, H, D] in q's dtype; computed in meta.prompt_dtype when set (torch's flash SDPA in
    bfloat16 blocks the scores and runs its GEMMs on the matrix units)."""
    ctx = seg.start_pos + seg.length
    plain = spec.softcap is None and not spec.cuts(ctx)  # no key hidden but the future ones
    kernel = meta.prompt_attention if meta is not None else None
    if kernel is not None and q.shape[-1] == 64 and plain:
        if seg.start_pos:  # the cached prefix and the chunk's own K/V, as cached
            kvh, d = k_cache.shape[2:]
            k = k_cache.index_select(0, seg.block_ids).view(-1, kvh, d)[:ctx].float()
            v = v_cache.index_select(0, seg.block_ids).view(-1, kvh, d)[:ctx].float()
        return kernel(q, k, v, spec.scale_for(q.shape[-1]))
    dtype = (meta.prompt_dtype if meta is not None else None) or q.dtype
    if dtype != q.dtype:
        return _prefill_attention_as(dtype, q, k, v, k_cache, v_cache, seg, spec)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if seg.start_pos == 0:  # nothing cached: attend within the chunk only
        keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if plain:
            o = sdpa(qh, keys, values, None, spec, is_causal=True)
            return o.squeeze(0).transpose(0, 1)
    else:
        kvh, d = k_cache.shape[2], k_cache.shape[3]
        keys = k_cache.index_select(0, seg.block_ids).view(-1, kvh, d)[:ctx].transpose(0, 1)[None]
        values = v_cache.index_select(0, seg.block_ids).view(-1, kvh, d)[:ctx]
        values = values.transpose(0, 1)[None]
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # a narrower --kv-cache-dtype
    return _masked_pieces(qh, keys, values, seg.start_pos, spec).squeeze(0).transpose(0, 1)


def _masked_pieces(
    qh: torch.Tensor,  # [1, H, n, D]: queries at positions first_pos ..
    keys: torch.Tensor,  # [1, KVH, ctx, D]: key i at position i
    values: torch.Tensor,
    first_pos: int,
    spec: AttentionSpec,
) -> torch.Tensor:
    """Causal (and windowed) attention with an explicit mask, PREFIX_PIECE queries a call.

    A masked SDPA computes every query against every key it is given: one call for the whole
    chunk would spend half its work on the masked upper triangle (a 1904-token chunk behind a
    96-token prefix hit took 1.9x a fresh 2000-token prompt). Pieces of PREFIX_PIECE queries
    each take only the keys from their first query's window to their last position."""
    out = torch.empty_like(qh)
    n, dev = qh.shape[2], qh.device
    for a in range(0, n, PREFIX_PIECE):
        b = min(n, a + PREFIX_PIECE)
        end = first_pos + b
        lo = 0 if spec.window is None else max(0, first_pos + a - spec.window + 1)
        q_pos = torch.arange(first_pos + a, end, device=dev)[:, None]
        k_pos = torch.arange(lo, end, device=dev)[None, :]
        mask = k_pos <= q_pos  # [b - a, end - lo]
        if spec.window is not None:
            mask &= k_pos > q_pos - spec.window
        out[:, :, a:b] = sdpa(qh[:, :, a:b], keys[:, :, lo:end], values[:, :, lo:end], mask, spec)
    return out


def _prefill_attention_as(
    dtype: torch.dtype,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: PrefillSegment,
    spec: AttentionSpec = PLAIN,
) -> torch.Tensor:
    """_prefill_attention on q, k, v (and the cached prefix) rounded to `dtype`; back in q's."""
    kc, vc = k_cache, v_cache
    if seg.start_pos:  # the prefix read in `dtype` too (a float16 cache: one rounding)
        kc = k_cache.index_select(0, seg.block_ids).to(dtype)
        vc = v_cache.index_select(0, seg.block_ids).to(dtype)
        seg = PrefillSegment(seg.start, seg.length, seg.start_pos, torch.arange(len(kc)))
    out = _prefill_attention(q.to(dtype), k.to(dtype), v.to(dtype), kc, vc, seg, spec=spec)
    return out.to(q.dtype)
