"""A prompt chunk over a cached prefix (`_prefill_attention`, start_pos > 0): computed in pieces
of PREFIX_PIECE queries, it must equal plain causal attention over prefix + chunk."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.attention import (
    PREFIX_PIECE,
    AttentionMetadata,
    PrefillSegment,
    _prefill_attention,
)

H, KVH, D, BS = 6, 2, 16, 4


def _reference(q, keys, values, start_pos):  # type: ignore[no-untyped-def]
    """float64 softmax(q k^T / sqrt(D)) v, query i seeing keys [0, start_pos + i]."""
    n, ctx = q.shape[0], keys.shape[0]
    kk = keys.double().repeat_interleave(H // KVH, dim=1)  # [ctx, H, D]
    vv = values.double().repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.double(), kk) / D**0.5
    visible = torch.arange(ctx)[None, :] <= (start_pos + torch.arange(n))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), vv)


@pytest.mark.parametrize(
    ("start_pos", "length"),
    [(0, 37), (5, 1), (7, PREFIX_PIECE - 1), (8, PREFIX_PIECE), (9, PREFIX_PIECE + 1), (13, 600)],
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_chunk_over_a_cached_prefix_matches_causal_attention(
    start_pos: int, length: int, cache_dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(start_pos * 1000 + length)
    ctx = start_pos + length
    n_blocks = -(-ctx // BS)
    num_blocks = n_blocks + 5
    table = torch.randperm(num_blocks, generator=g)[:n_blocks]  # blocks anywhere in the cache
    k_cache = torch.randn(num_blocks, BS, KVH, D, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, BS, KVH, D, generator=g).to(cache_dtype)
    q = torch.randn(length, H, D, generator=g)
    k = torch.randn(length, KVH, D, generator=g)
    v = torch.randn(length, KVH, D, generator=g)
    # The step writes the chunk's own K/V into the cache before attention reads it.
    slots = table[torch.arange(start_pos, ctx) // BS] * BS + torch.arange(start_pos, ctx) % BS
    k_cache.view(-1, KVH, D)[slots] = k.to(cache_dtype)
    v_cache.view(-1, KVH, D)[slots] = v.to(cache_dtype)
    seg = PrefillSegment(start=0, length=length, start_pos=start_pos, block_ids=table)
    got = _prefill_attention(q, k, v, k_cache, v_cache, seg)
    all_slots = table[torch.arange(ctx) // BS] * BS + torch.arange(ctx) % BS
    keys = k_cache.view(-1, KVH, D)[all_slots].float()
    values = v_cache.view(-1, KVH, D)[all_slots].float()
    if start_pos == 0:  # a fresh prompt attends to its own float32 K/V, not the rounded cache
        keys, values = k, v
    want = _reference(q, keys, values, start_pos)
    assert got.shape == (length, H, D)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("start_pos", "length"), [(0, 300), (13, 40), (20, 600)])
def test_chunk_attention_in_bf16_stays_close(start_pos: int, length: int) -> None:
    """The prefill format's attention (meta.prompt_dtype bfloat16: q, k, v and the cached prefix
    rounded, torch's flash SDPA): float32 out, within bf16's rounding of the exact result."""
    g = torch.Generator().manual_seed(length)
    ctx = start_pos + length
    n_blocks = -(-ctx // BS)
    table = torch.randperm(n_blocks + 3, generator=g)[:n_blocks]
    k_cache = torch.randn(n_blocks + 3, BS, KVH, D, generator=g).half()
    v_cache = torch.randn(n_blocks + 3, BS, KVH, D, generator=g).half()
    q, k, v = (torch.randn(length, n, D, generator=g) for n in (H, KVH, KVH))
    slots = table[torch.arange(start_pos, ctx) // BS] * BS + torch.arange(start_pos, ctx) % BS
    k_cache.view(-1, KVH, D)[slots] = k.half()
    v_cache.view(-1, KVH, D)[slots] = v.half()
    seg = PrefillSegment(start=0, length=length, start_pos=start_pos, block_ids=table)
    meta = AttentionMetadata(torch.empty(0), torch.empty(0), prompt_dtype=torch.bfloat16)
    got = _prefill_attention(q, k, v, k_cache, v_cache, seg, meta)
    exact = _prefill_attention(q, k, v, k_cache, v_cache, seg)
    assert got.dtype == torch.float32 and got.shape == (length, H, D)
    torch.testing.assert_close(got, exact, rtol=0.05, atol=0.03)
