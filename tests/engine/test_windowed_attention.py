"""Sliding windows and soft-capped scores (AttentionSpec) on every attention path: the paged
kernel (fast and generic head sizes, split contexts), gathered decodes, fresh and cached-prefix
prompt chunks, and the prefill formats' bfloat16 SDPA / AMX causal kernel; each against a
float64 reference in which a row at position p sees keys (p - window, p]."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine import model_runner
from pdserve.engine.model_runner import ModelRunner, resolve_attention
from pdserve.engine.models.arch import AttentionSpec
from pdserve.engine.models.attention import PrefillSegment, _prefill_attention, paged_attention
from pdserve.engine.scheduler import ScheduledRequest

needs_kernel = pytest.mark.skipif(
    resolve_attention("auto", torch.device("cpu")) != "paged", reason="needs AVX2"
)
SPECS = [
    AttentionSpec(window=5),
    AttentionSpec(window=37, softcap=2.0),
    AttentionSpec(scale=0.3, softcap=1.5),
    AttentionSpec(scale=0.2, window=16),
]


def _reference(q, keys, values, positions, spec):  # type: ignore[no-untyped-def]
    """float64 attention of rows q [n, H, D] at `positions` over keys [ctx, KVH, D]."""
    heads, d = q.shape[1], q.shape[2]
    group = heads // keys.shape[1]
    kk = keys.double().repeat_interleave(group, dim=1)
    vv = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.double(), kk) * spec.scale_for(d)
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    k_pos = torch.arange(keys.shape[0])[None, :]
    p = torch.tensor(positions)[:, None]
    visible = k_pos <= p
    if spec.window is not None:
        visible &= k_pos > p - spec.window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), vv)


def _layout(spec_rows, bs, seed, heads, kv_heads, head_dim):  # type: ignore[no-untyped-def]
    """Requests (cached, new) over random non-contiguous blocks; random caches and q/k/v."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-(c + n) // bs) + 1 for c, n in spec_rows) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    sched = []
    for i, (cached, new) in enumerate(spec_rows):
        table = [free.pop() for _ in range(-(-(cached + new) // bs))]
        sched.append(ScheduledRequest(f"r{i}", [5] * new, cached, table, sample=True))
    shape = (num_blocks, bs, kv_heads, head_dim)
    t = sum(n for _, n in spec_rows)
    tensors = [torch.randn(shape), torch.randn(shape)]
    tensors += [torch.randn(t, heads, head_dim)]
    tensors += [torch.randn(t, kv_heads, head_dim), torch.randn(t, kv_heads, head_dim)]
    return sched, tensors


def _run(backend, sched, tensors, spec, bs):  # type: ignore[no-untyped-def]
    k_cache, v_cache, q, k, v = tensors
    decodes = [s for s in sched if s.num_tokens == 1]
    chunks = [s for s in sched if s.num_tokens > 1]
    cache = SimpleNamespace(block_size=bs, layers=[])
    runner = ModelRunner(None, cache, torch.device("cpu"), backend)  # type: ignore[arg-type]
    _, meta = runner._prepare(decodes, chunks)
    kv = (k_cache.clone(), v_cache.clone())
    out = paged_attention(q, k, v, kv, meta, spec)
    # The reference, row by row in the runner's order, over each sequence's keys as cached.
    want, row = torch.empty_like(out, dtype=torch.float64), 0
    for s in decodes + chunks:
        ctx = s.start_pos + s.num_tokens
        keys = kv[0][s.block_ids].flatten(0, 1)[:ctx]
        values = kv[1][s.block_ids].flatten(0, 1)[:ctx]
        rows = slice(row, row + s.num_tokens)
        positions = list(range(s.start_pos, ctx))
        want[rows] = _reference(q[rows], keys, values, positions, spec)
        row += s.num_tokens
    return out, want


# (5, 33): two kernel tiles with the runner's bound raised to MULTI_TILE (by default one tile)
MULTI_TILE = 64
MIXED = [(0, 1), (3, 1), (40, 1), (700, 1), (30, 7), (5, 33), (12, MULTI_TILE + 5), (0, 20)]


@pytest.mark.parametrize("backend", [pytest.param("paged", marks=needs_kernel), "gather"])
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("head_dim", [16, 24])
def test_every_path_applies_window_and_softcap(backend, spec, head_dim, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Decodes, kernel chunks over a prefix (one of several tiles), a long chunk over a prefix
    and a fresh prompt longer than the window, in one step: head_dim 16 the kernel's
    vectorised path, 24 its generic one."""
    monkeypatch.setattr(model_runner, "PAGED_CHUNK_MAX", MULTI_TILE)
    sched, tensors = _layout(MIXED, 4, 3, 6, 2, head_dim)
    got, want = _run(backend, sched, tensors, spec, 4)
    assert (got.double() - want).abs().max().item() <= 3e-5


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_window_over_split_long_contexts(threads: int) -> None:
    """Contexts past the kernel's 512-key split with a window that starts mid-block: the
    items start at the window's block and merge as without one."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = [(2000, 1), (1030, 1), (513, 1), (600, 9)]
        sched, tensors = _layout(rows, 16, 8, 9, 3, 64)
        for spec in (AttentionSpec(window=700), AttentionSpec(window=45, softcap=3.0)):
            got, want = _run("paged", sched, tensors, spec, 16)
            assert (got.double() - want).abs().max().item() <= 3e-5
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_kernel_rejects_a_bad_window() -> None:
    from pdserve.engine import kernels

    kernel = kernels.load("paged_attention").paged_attention
    cache, q = torch.zeros(2, 4, 1, 8), torch.zeros(1, 1, 8)
    args = (torch.tensor([[0]], dtype=torch.int32), torch.tensor([[0, 0, 1]], dtype=torch.int32))
    one = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="window must be"):
        kernel(q, cache, cache, *args, one, 512, 1.0, window=0)


def _fresh_chunk(n: int, seed: int = 0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    q, k, v = torch.randn(n, 4, 64), torch.randn(n, 2, 64), torch.randn(n, 2, 64)
    cache = torch.zeros(1, 4, 2, 64)
    return q, k, v, cache, PrefillSegment(0, n, 0, torch.zeros(1, dtype=torch.long))


def test_bfloat16_prompt_attention_applies_the_window() -> None:
    """The bf16 prefill format's SDPA (meta.prompt_dtype): a windowed prompt of 600 tokens
    (several PREFIX_PIECE pieces) within bfloat16 rounding of the float64 reference, and far
    from plain causal attention."""
    q, k, v, cache, seg = _fresh_chunk(600)
    meta = SimpleNamespace(prompt_dtype=torch.bfloat16, prompt_attention=None)
    spec = AttentionSpec(window=48)
    got = _prefill_attention(q, k, v, cache, cache, seg, meta, spec)  # type: ignore[arg-type]
    want = _reference(q, k, v, list(range(600)), spec)
    assert (got.double() - want).abs().max().item() < 0.05
    causal = _reference(q, k, v, list(range(600)), AttentionSpec())
    assert (causal - want).abs().max().item() > 0.2


def test_amx_causal_kernel_only_runs_where_nothing_is_cut() -> None:
    """bf16x3's causal kernel (meta.prompt_attention) computes plain causal attention: a chunk
    the window cuts, or a soft-capped layer, runs SDPA instead; one within the window keeps it."""
    calls = []

    def kernel(q, k, v, scale):  # type: ignore[no-untyped-def]
        calls.append(q.shape[0])
        return _reference(q, k, v, list(range(q.shape[0])), AttentionSpec(scale=scale)).float()

    meta = SimpleNamespace(prompt_dtype=None, prompt_attention=kernel)
    for n, spec in ((100, AttentionSpec(window=48)), (30, AttentionSpec(window=48))):
        q, k, v, cache, seg = _fresh_chunk(n)
        got = _prefill_attention(q, k, v, cache, cache, seg, meta, spec)  # type: ignore[arg-type]
        want = _reference(q, k, v, list(range(n)), spec)
        assert (got.double() - want).abs().max().item() <= 3e-5
    q, k, v, cache, seg = _fresh_chunk(30)
    _prefill_attention(q, k, v, cache, cache, seg, meta, AttentionSpec(softcap=2.0))  # type: ignore[arg-type]
    assert calls == [30]
