"""SchedulerOutput -> batch tensors -> model -> logits of the rows to sample.

Row order in the flat batch: single-token decodes first (one batched attention call), then
prompt chunks. Only requests whose step reaches their last known token are sampled. A decode
with k draft tokens (speculation, engine/spec/) is a chunk of 1 + k tokens over its cached
prefix, in the paged kernel like any short chunk, and returns the logits of all 1 + k rows.

Attention backends (`--attention`):
  * `paged`: decodes and short prompt chunks over a cached prefix (<= PAGED_CHUNK_MAX tokens:
    one kernel tile, which takes a verify chunk of 1 + k drafts) read K/V in place from the
    block cache with the native kernel (engine/kernels); a fresh prompt chunk attends to its
    own keys with SDPA (no cache read), and a longer chunk over a cached prefix gathers the
    prefix (its attention is compute-bound: the copy is O(prefix), the attention
    O(chunk x prefix)). CPU only.
  * `gather`: the reference — every row copies the blocks it reads into a new tensor, then
    SDPA. The CUDA path, and the oracle the kernel is tested against.
All index tensors of a step are built here once and shared by every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.models.attention import AttentionMetadata, PagedPlan, PrefillSegment
from pdserve.engine.models.llama import LlamaModel
from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput

ATTENTION_BACKENDS = ("auto", "paged", "gather")
TILE_ROWS = 16  # query rows of one sequence per kernel work item (kMaxTile in the kernel)
# Chunks over a cached prefix longer than this run SDPA on the gathered prefix. Past one tile the
# kernel is compute-bound (AVX2, every tile re-reads every key) and SDPA's GEMMs are faster.
# Measured per layer of the default model (9 heads, 3 KV heads, float16 cache), one thread,
# Intel Xeon (AVX-512, AMX), after a 1800-token prefix, kernel / SDPA: 8 rows 0.77 / 1.20 ms,
# 16 rows 1.63 / 1.66, 32 rows 3.71 / 2.57, 52 rows 5.74 / 4.12 (after 600: 16 rows 0.60 /
# 0.59, 32 rows 1.20 / 0.86). At 64 (the old bound) a conversation's 48-token follow-up
# prefilled on the D holding its history (60 rows over ~1800 cached tokens) spent 290 of its
# 490 ms step in the kernel; through SDPA the step took 378 ms (issue 47).
PAGED_CHUNK_MAX = TILE_ROWS


@dataclass(frozen=True)
class RowSpan:
    """Where one request's tokens sit in the flat batch of a step."""

    request_id: str
    row: int  # first row in the batch
    num_tokens: int
    start_pos: int  # position of the first of these tokens in the request


# hook(layer, k, v, spans): k and v are [T, KVH, D], rows as laid out by `spans`.
LayerHook = Callable[[int, torch.Tensor, torch.Tensor, list[RowSpan]], None]


@dataclass
class StepResult:
    request_ids: list[str]  # requests sampled this step, in row order of `logits`
    logits: torch.Tensor  # [S, vocab] float32
    # per request: its draft tokens (speculation), each with a logits row after its own row
    num_drafts: list[int] | None = None


def resolve_attention(attention: str, device: torch.device) -> str:
    """`auto` is `paged` on CPU and `gather` on CUDA; `paged` on CUDA is an error."""
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
    if attention == "auto":
        return "paged" if device.type == "cpu" else "gather"
    if attention == "paged" and device.type != "cpu":
        raise ValueError("--attention paged is CPU only; use gather (or auto) on CUDA")
    return attention


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: PagedKVCache,
        device: torch.device,
        attention: str = "auto",
    ) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.block_size = cache.block_size
        self.layer_hook: LayerHook | None = None
        self.attention = resolve_attention(attention, device)
        self._kernel: Callable[..., torch.Tensor] | None = None
        if self.attention == "paged":  # build/load the kernel now, off the request path
            from pdserve.engine import kernels

            self._kernel = kernels.load("paged_attention").paged_attention

    def use_attention_build(self, isa: str) -> None:
        """Run the paged attention kernel's `isa` build from the next step on (`bench
        spec-crossover --attention-builds` times builds side by side on one engine); refused
        where this CPU cannot run it, or where the runner gathers instead."""
        from pdserve.engine import kernels

        if self._kernel is None:
            raise ValueError(f"attention {self.attention!r} runs no paged kernel to rebuild")
        self._kernel = kernels.load("paged_attention", isa).paged_attention

    def execute(self, out: SchedulerOutput) -> StepResult:
        decodes = [s for s in out.scheduled if s.num_tokens == 1]
        verify = [s for s in out.scheduled if s.num_tokens > 1 and s.num_draft]
        chunks = verify + [s for s in out.scheduled if s.num_tokens > 1 and not s.num_draft]
        ordered = decodes + chunks
        input_ids, meta = self._prepare(decodes, chunks)
        if verify:  # decode rows too: the weight format of decodes (engine/linear/phases.py)
            meta.decode_rows = len(decodes) + sum(s.num_tokens for s in verify)
        if self.layer_hook is not None:
            meta.layer_hook = self._bind_hook(self.layer_hook, ordered)
        if meta.sliding is not None:
            meta.sliding.decode_rows, meta.sliding.layer_hook = meta.decode_rows, meta.layer_hook
        sampled = [s for s in ordered if s.sample]
        logits = self.model(input_ids, meta, self.cache.layers)
        drafts = [s.num_draft for s in sampled]
        return StepResult([s.request_id for s in sampled], logits, drafts if any(drafts) else None)

    @staticmethod
    def _bind_hook(
        hook: LayerHook, ordered: list[ScheduledRequest]
    ) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        spans, row = [], 0
        for s in ordered:
            spans.append(RowSpan(s.request_id, row, s.num_tokens, s.start_pos))
            row += s.num_tokens
        return lambda layer, k, v: hook(layer, k, v, spans)

    def _prepare(
        self, decodes: list[ScheduledRequest], chunks: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        tokens: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for s in decodes + chunks:
            positions.extend(range(s.start_pos, s.start_pos + s.num_tokens))
            tokens.extend(s.token_ids)
            if s.sample:  # a verify chunk: its last real token's row and every draft's
                sample_rows.extend(range(len(tokens) - 1 - s.num_draft, len(tokens)))
        dev = self.device
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.empty(0, dtype=torch.long, device=dev),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            num_decodes=len(decodes),
        )
        self._index(meta, decodes, chunks, _table)
        if any(s.sliding_block_ids is not None for s in decodes + chunks):
            # KV groups (engine/hybrid_kv.py): the sliding layers index their own blocks
            meta.sliding = AttentionMetadata(meta.positions, meta.slot_mapping, len(decodes))
            meta.sliding.sample_rows = meta.sample_rows
            self._index(meta.sliding, decodes, chunks, _sliding_table)
        return torch.tensor(tokens, dtype=torch.long, device=dev), meta

    def _index(
        self,
        meta: AttentionMetadata,
        decodes: list[ScheduledRequest],
        chunks: list[ScheduledRequest],
        table_of: TableOf,
    ) -> None:
        """The index tensors of the layers whose KV group's table `table_of` gives: slots,
        prompt chunks' tables, and the kernel's plan or the decodes' gathered tables."""
        bs, dev = self.block_size, self.device
        slots: list[int] = []
        for s in decodes + chunks:
            table = table_of(s)
            for pos in range(s.start_pos, s.start_pos + s.num_tokens):
                slots.append(table[pos // bs] * bs + pos % bs)
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        paged = self._kernel is not None
        if decodes and not paged:
            self._prepare_decodes(decodes, meta, table_of)
        row = len(decodes)
        for s in chunks:
            table_t = torch.tensor(table_of(s), dtype=torch.long, device=dev)
            in_kernel = paged and s.start_pos > 0 and s.num_tokens <= PAGED_CHUNK_MAX
            meta.prefills.append(PrefillSegment(row, s.num_tokens, s.start_pos, table_t, in_kernel))
            row += s.num_tokens
        if paged:
            meta.paged = self._paged_plan(decodes, chunks, meta, len(slots), table_of)

    def _paged_plan(
        self,
        decodes: list[ScheduledRequest],
        chunks: list[ScheduledRequest],
        meta: AttentionMetadata,
        num_rows: int,
        table_of: TableOf,
    ) -> PagedPlan:
        """Tiles for the decode rows and the kernel's prompt chunks; limits per row (causal)."""
        assert self._kernel is not None
        bs = self.block_size
        tables: list[list[int]] = []
        tiles: list[tuple[int, int, int]] = []
        limits = [0] * num_rows
        for i, s in enumerate(decodes):
            limits[i] = s.start_pos + 1
            tiles.append((len(tables), i, 1))
            tables.append(table_of(s)[: -(-limits[i] // bs)])
        for seg, s in zip(meta.prefills, chunks, strict=True):
            if not seg.paged:
                continue
            for r in range(seg.length):
                limits[seg.start + r] = seg.start_pos + r + 1
            for r0 in range(0, seg.length, TILE_ROWS):
                tiles.append((len(tables), seg.start + r0, min(TILE_ROWS, seg.length - r0)))
            tables.append(table_of(s)[: -(-(seg.start_pos + seg.length) // bs)])
        width = max((len(t) for t in tables), default=1)
        padded = [t + [0] * (width - len(t)) for t in tables] or [[0]]
        dev = self.device
        return PagedPlan(
            tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            tiles=torch.tensor(tiles, dtype=torch.int32, device=dev).view(-1, 3),
            limits=torch.tensor(limits, dtype=torch.int32, device=dev),
            kernel=self._kernel,
            writes_kv=True,
        )

    def _prepare_decodes(
        self, decodes: list[ScheduledRequest], meta: AttentionMetadata, table_of: TableOf
    ) -> None:
        bs = self.block_size
        ctx_lens = [s.start_pos + 1 for s in decodes]
        width = max(-(-n // bs) for n in ctx_lens)
        tables = [table_of(s) for s in decodes]
        table = [t[:width] + [0] * (width - min(width, len(t))) for t in tables]
        dev = self.device
        meta.decode_block_table = torch.tensor(table, dtype=torch.long, device=dev)
        lens = torch.tensor(ctx_lens, dtype=torch.long, device=dev)
        mask = torch.arange(width * bs, device=dev)[None, :] < lens[:, None]  # [B, L]
        meta.decode_mask = mask[:, None, None, :]


TableOf = Callable[[ScheduledRequest], list[int]]


def _table(s: ScheduledRequest) -> list[int]:
    return s.block_ids


def _sliding_table(s: ScheduledRequest) -> list[int]:
    return s.block_ids if s.sliding_block_ids is None else s.sliding_block_ids
