"""The in-place paged attention kernel against the gather reference on random paged layouts."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine import model_runner
from pdserve.engine.model_runner import PAGED_CHUNK_MAX, ModelRunner, resolve_attention
from pdserve.engine.models.llama import paged_attention
from pdserve.engine.scheduler import ScheduledRequest

pytestmark = pytest.mark.skipif(
    resolve_attention("auto", torch.device("cpu")) != "paged", reason="needs AVX2"
)
# The runner sends the kernel chunks of one tile at most (PAGED_CHUNK_MAX); the kernel itself
# takes any number of tiles, so tests of its multi-tile paths raise the bound to this.
MULTI_TILE = 64


@pytest.fixture(autouse=True, params=["avx2", "avx512"])
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on each build of the kernel this CPU runs (the AVX-512 one groups up to 6
    queries per K/V row loaded, the AVX2 one 3): runners load that build."""
    from pdserve.engine import kernels

    isa = str(request.param)
    if not kernels.runs_here(isa):
        pytest.skip(f"this CPU does not run the kernel's {isa} build")
    real = kernels.load

    def load(name: str, want: str | None = None):  # type: ignore[no-untyped-def]
        return real(name, want or (isa if name == "paged_attention" else None))

    monkeypatch.setattr(kernels, "load", load)
    return isa


def _runner(attention: str, block_size: int) -> ModelRunner:
    cache = SimpleNamespace(block_size=block_size, layers=[])
    return ModelRunner(None, cache, torch.device("cpu"), attention)  # type: ignore[arg-type]


def _scheduled(rng: random.Random, spec: list[tuple[int, int]], bs: int, num_blocks: int):
    """spec: (cached tokens, new tokens) per request; blocks drawn at random (non-contiguous)."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    out = []
    for i, (cached, new) in enumerate(spec):
        n_blocks = -(-(cached + new) // bs) + rng.randint(0, 2)  # tables may run past the end
        table = [free.pop() for _ in range(n_blocks)]
        tokens = [rng.randint(3, 100) for _ in range(new)]
        out.append(ScheduledRequest(f"r{i}", tokens, cached, table, sample=True))
    return out


def _compare(
    spec, *, heads=6, kv_heads=2, head_dim=16, bs=4, dtype=torch.float32, seed=0, cache_dtype=None
):
    """Gather reference and paged kernel on one random layout; `cache_dtype` (default: dtype)
    is the KV cache's element type, as `--kv-cache-dtype` sets it."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-(c + n) // bs) + 2 for c, n in spec) + 3
    sched = _scheduled(rng, spec, bs, num_blocks)
    decodes = [s for s in sched if s.num_tokens == 1]
    chunks = [s for s in sched if s.num_tokens > 1]
    t = sum(s.num_tokens for s in sched)
    shape = (num_blocks, bs, kv_heads, head_dim)
    cdt = cache_dtype or dtype
    k_cache, v_cache = torch.randn(shape, dtype=cdt), torch.randn(shape, dtype=cdt)
    q = torch.randn(t, heads, head_dim, dtype=dtype)
    k = torch.randn(t, kv_heads, head_dim, dtype=dtype)
    v = torch.randn(t, kv_heads, head_dim, dtype=dtype)
    outs = []
    for backend in ("gather", "paged"):
        _, meta = _runner(backend, bs)._prepare(decodes, chunks)
        assert (meta.paged is not None) == (backend == "paged")
        kv = (k_cache.clone(), v_cache.clone())
        outs.append(paged_attention(q, k, v, kv, meta))
    return outs


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-5) -> None:
    assert a.shape == b.shape
    assert torch.isfinite(a).all()
    assert (a.float() - b.float()).abs().max().item() <= tol


def test_decodes_of_mixed_lengths_gqa() -> None:
    ref, got = _compare([(c, 1) for c in (0, 1, 3, 4, 5, 17, 64, 100, 700)])
    _close(got, ref)


@pytest.mark.parametrize("threads", [1, 2])
def test_long_context_splits_merge(threads: int) -> None:
    """With two threads, contexts beyond the kernel's split (512 keys) merge partial softmaxes
    exactly; with one, each is one range."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref, got = _compare([(2000, 1), (513, 1), (511, 1), (1024, 1)], bs=16, seed=1)
    finally:
        torch.set_num_threads(before)
    _close(got, ref)


@pytest.mark.parametrize("chunk_max", [PAGED_CHUNK_MAX, MULTI_TILE])
def test_mixed_decode_and_prefill_batch_with_cached_prefixes(
    chunk_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decodes, short chunks over a cached prefix (kernel; with MULTI_TILE incl. > one 16-row
    tile), longer ones over a prefix (gather) and fresh prompts (SDPA) in one step."""
    monkeypatch.setattr(model_runner, "PAGED_CHUNK_MAX", chunk_max)
    spec = [(9, 1), (40, 1), (30, 7), (5, 33), (12, MULTI_TILE + 5), (0, 20), (0, 3)]
    ref, got = _compare(spec, seed=2)
    _close(got, ref)


def test_only_chunks_of_one_tile_over_a_prefix_take_the_kernel() -> None:
    """Past one tile the kernel is compute-bound and slower than SDPA's GEMMs (model_runner's
    measurements): a chunk of 16 tokens over a prefix (a verify chunk of 1 + 15 drafts too)
    runs in the kernel, one of 17 or a follow-up's 60 gathers its prefix for SDPA, and a fresh
    chunk never reads the cache."""
    spec = [(40, 1), (30, 16), (30, 17), (1800, 60), (0, 8)]
    sched = _scheduled(random.Random(0), spec, 16, 200)
    sched[1].num_draft = 15
    _, meta = _runner("paged", 16)._prepare(sched[:1], sched[1:])
    assert [seg.paged for seg in meta.prefills] == [True, False, False, False]
    assert meta.paged is not None and meta.paged.tiles.tolist() == [[0, 0, 1], [1, 1, 16]]


@pytest.mark.parametrize("head_dim", [16, 64])
def test_prompt_rows_whose_keys_end_before_a_span(
    head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A softmax pass covers a span of 4 blocks: prompt rows whose visible keys end before a
    span starts (limits 13..16 against the span from key 16, block size 4) take nothing from it
    while the tile's later rows do; a span cut short by the item's end; 4 rows per GQA group of
    3 (groups of 3, 1)."""
    monkeypatch.setattr(model_runner, "PAGED_CHUNK_MAX", MULTI_TILE)  # (3, 30): two tiles
    spec = [(12, 9), (15, 2), (47, 14), (3, 30)]
    ref, got = _compare(spec, heads=9, kv_heads=3, head_dim=head_dim, bs=4, seed=11)
    _close(got, ref)


def test_the_kernel_writes_the_steps_kv_in_the_same_call() -> None:
    """paged_attention(..., slots, k, v) stores this step's K/V first (what write_kv stores) and
    attends over it: the same cache and output as the two calls; slots, k and v come together."""
    from pdserve.engine import kernels

    mod = kernels.load("paged_attention")
    torch.manual_seed(0)
    kvh, d, bs = 3, 64, 16
    k_cache = torch.randn(8, bs, kvh, d).half()
    v_cache = torch.randn(8, bs, kvh, d).half()
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    tiles = torch.tensor([[0, 0, 1]], dtype=torch.int32)
    limit = torch.tensor([40], dtype=torch.int32)
    q, k, v = torch.randn(1, 9, d), torch.randn(1, kvh, d), torch.randn(1, kvh, d)
    slot = torch.tensor([7 * bs + 7])  # token 39: the row's own key, the last it sees
    args = (table, tiles, limit, 512, 0.125)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    mod.write_kv(want_k, want_v, slot, k, v)
    want = mod.paged_attention(q, want_k, want_v, *args)
    got = mod.paged_attention(q, k_cache, v_cache, *args, slot, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="come together"):
        mod.paged_attention(q, k_cache, v_cache, *args, slot, k)


@pytest.mark.parametrize("spec", [[(1024, 1)], [(2000, 1)], [(130, 1), (9, 1), (700, 1)]])
def test_two_threads_split_ranges_and_items(spec: list[tuple[int, int]]) -> None:
    """Two threads: batch 1's key range is cut into a multiple of two equal block ranges, and a
    thread's items prefetch into the next item's blocks; the results are the reference's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ref, got = _compare(spec, heads=9, kv_heads=3, head_dim=64, bs=16, seed=7)
    finally:
        torch.set_num_threads(threads)
    _close(got, ref)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 1), (9, 3)])
def test_head_layouts(heads: int, kv_heads: int) -> None:
    ref, got = _compare([(50, 1), (7, 1), (20, 10)], heads=heads, kv_heads=kv_heads, seed=3)
    _close(got, ref)


@pytest.mark.parametrize("head_dim", [64, 24])
def test_head_dims_fast_and_generic_paths(head_dim: int) -> None:
    """float32 with head_dim 64 (the default model's: 9 query heads over 3 KV heads, blocks of
    16, a split context) runs the vectorised path; 24 the generic one."""
    spec = [(1030, 1), (37, 1), (200, 1), (15, 9), (40, 17)]
    ref, got = _compare(spec, heads=9, kv_heads=3, head_dim=head_dim, bs=16, seed=5)
    _close(got, ref)


@pytest.mark.parametrize("head_dim", [8, 32, 64, 96, 128])
def test_tiles_of_every_group_width(head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 2..7 rows over a cached prefix under 8 query heads per KV head: 16..56
    queries per tile, so groups of every width from 1 to 6 (AVX-512: 6 queries a group when
    head_dim is a multiple of 16; head_dim 8 keeps the 8-float path in both builds)."""
    monkeypatch.setattr(model_runner, "PAGED_CHUNK_MAX", MULTI_TILE)
    spec = [(70, 1), (33, 2), (90, 3), (17, 4), (150, 5), (40, 6), (600, 7)]
    ref, got = _compare(spec, heads=8, kv_heads=1, head_dim=head_dim, bs=16, seed=12)
    _close(got, ref)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(cache_dtype: torch.dtype) -> None:
    """A verify step's rows (the last token and its drafts, one tile) give bit for bit what
    each row gives as a decode of its own: a query's sums run in the same order whatever group
    it lands in, which greedy speculation needs to match decoding without it. One thread (with
    two, a tile's key range is split by its longest row)."""
    from pdserve.engine import kernels

    mod = kernels.load("paged_attention")
    torch.manual_seed(3)
    kvh, d, bs, ctx, rows = 3, 64, 16, 200, 5
    k_cache = torch.randn(16, bs, kvh, d).to(cache_dtype)
    v_cache = torch.randn(16, bs, kvh, d).to(cache_dtype)
    table = torch.tensor([[9, 2, 14, 0, 5, 11, 7, 3, 12, 1, 6, 8, 4, 15]], dtype=torch.int32)
    q = torch.randn(rows, 9, d)
    limit = torch.arange(ctx + 1, ctx + 1 + rows, dtype=torch.int32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tile = torch.tensor([[0, 0, rows]], dtype=torch.int32)
        together = mod.paged_attention(q, k_cache, v_cache, table, tile, limit, 512, 0.125)
        one = torch.tensor([[0, 0, 1]], dtype=torch.int32)
        alone = [
            mod.paged_attention(
                q[r : r + 1], k_cache, v_cache, table, one, limit[r : r + 1], 512, 0.125
            )
            for r in range(rows)
        ]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, torch.cat(alone))


def test_bfloat16_close_to_reference() -> None:
    ref, got = _compare([(60, 1), (3, 1), (25, 9)], dtype=torch.bfloat16, seed=4)
    _close(got, ref, tol=3e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_narrow_cache_under_float32_queries(cache_dtype: torch.dtype, head_dim: int) -> None:
    """--kv-cache-dtype float16 / bfloat16 under a float32 model: the kernel widens each key as
    it loads it (float16 at head_dim 64: the vectorised path; bfloat16 and 24: the generic one)
    and matches the reference, which widens the gathered blocks, to float32 rounding: the
    cache's own rounding is the same on both sides. Split contexts and a cached-prefix chunk."""
    spec = [(1030, 1), (37, 1), (15, 9), (40, 17), (0, 5)]
    ref, got = _compare(
        spec, heads=9, kv_heads=3, head_dim=head_dim, bs=16, seed=6, cache_dtype=cache_dtype
    )
    assert got.dtype == torch.float32
    _close(got, ref, tol=5e-5)


def test_cache_wider_than_the_queries_is_an_error() -> None:
    from pdserve.engine import kernels

    kernel = kernels.load("paged_attention").paged_attention
    cache = torch.zeros(2, 4, 1, 8)
    q = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    tiles = torch.tensor([[0, 0, 1]], dtype=torch.int32)
    one = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="float16 / bfloat16 under float32"):
        kernel(q, cache, cache, torch.tensor([[0]], dtype=torch.int32), tiles, one, 512, 1.0)


def test_block_table_out_of_range_is_an_error() -> None:
    """The kernel checks its indices instead of reading outside the cache."""
    from pdserve.engine import kernels

    kernel = kernels.load("paged_attention").paged_attention
    cache = torch.zeros(2, 4, 1, 8)
    q = torch.zeros(1, 1, 8)
    tiles = torch.tensor([[0, 0, 1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel(
            q,
            cache,
            cache,
            torch.tensor([[5]], dtype=torch.int32),
            tiles,
            torch.tensor([1], dtype=torch.int32),
            512,
            1.0,
        )


def test_paged_on_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        resolve_attention("paged", torch.device("cuda"))
    with pytest.raises(ValueError, match="attention must be"):
        resolve_attention("flash", torch.device("cpu"))
    assert resolve_attention("auto", torch.device("cuda")) == "gather"


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_native_kv_write_stores_exactly_what_torch_stores(cache_dtype: torch.dtype) -> None:
    """write_kv (the paged path's cache write) against torch's .to + index_copy_: the same
    bytes, from K/V rows strided as the fused q|k|v output leaves them, float16 rounding to
    nearest even included (ties, a subnormal, an overflow to inf), and a row length that is
    not a multiple of 8 (the scalar tail)."""
    from pdserve.engine import kernels

    write = kernels.load("paged_attention").write_kv
    torch.manual_seed(0)
    t, kvh, d = 5, 3, 6
    qkv = torch.randn(t, 4 * d + 2 * kvh * d) * 100
    qkv[0, 4 * d : 4 * d + 4] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1e-6, 70000.0])
    k = qkv[:, 4 * d : 4 * d + kvh * d].view(t, kvh, d)
    v = qkv[:, 4 * d + kvh * d :].view(t, kvh, d)
    slots = torch.tensor([0, 23, 7, 8, 15])
    want_k, want_v = (
        torch.zeros(6, 4, kvh, d, dtype=cache_dtype),
        torch.zeros(6, 4, kvh, d, dtype=cache_dtype),
    )
    want_k.view(-1, kvh, d).index_copy_(0, slots, k.to(cache_dtype))
    want_v.view(-1, kvh, d).index_copy_(0, slots, v.to(cache_dtype))
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    write(got_k, got_v, slots, k, v)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_native_kv_write_refuses_what_it_cannot_store() -> None:
    from pdserve.engine import kernels

    write = kernels.load("paged_attention").write_kv
    cache, rows = torch.zeros(2, 4, 1, 8), torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        write(cache, cache, torch.tensor([8]), rows, rows)
    with pytest.raises(RuntimeError, match="float32 or float16"):
        bf16 = cache.to(torch.bfloat16)
        write(bf16, bf16, torch.tensor([0]), rows, rows)
    with pytest.raises(RuntimeError, match="must be float32"):
        write(cache, cache, torch.tensor([0]), rows.half(), rows.half())
