"""SchedulerOutput -> batch tensors -> model -> logits of the rows to sample.

Row order in the flat batch: single-token decodes first (one batched attention call), then
prompt chunks. Only requests whose step reaches their last known token are sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.models.llama import AttentionMetadata, LlamaModel, PrefillSegment
from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput


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


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache, device: torch.device) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.block_size = cache.block_size
        self.layer_hook: LayerHook | None = None

    def execute(self, out: SchedulerOutput) -> StepResult:
        decodes = [s for s in out.scheduled if s.num_tokens == 1]
        chunks = [s for s in out.scheduled if s.num_tokens > 1]
        ordered = decodes + chunks
        input_ids, meta = self._prepare(decodes, chunks)
        if self.layer_hook is not None:
            meta.layer_hook = self._bind_hook(self.layer_hook, ordered)
        sampled = [s.request_id for s in ordered if s.sample]
        logits = self.model(input_ids, meta, self.cache.layers)
        return StepResult(sampled, logits)

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
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        for s in decodes + chunks:
            for i in range(s.num_tokens):
                pos = s.start_pos + i
                slots.append(s.block_ids[pos // bs] * bs + pos % bs)
            positions.extend(range(s.start_pos, s.start_pos + s.num_tokens))
            tokens.extend(s.token_ids)
            if s.sample:
                sample_rows.append(len(tokens) - 1)
        dev = self.device
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
        )
        if decodes:
            self._prepare_decodes(decodes, meta)
        row = len(decodes)
        for s in chunks:
            table = torch.tensor(s.block_ids, dtype=torch.long, device=dev)
            meta.prefills.append(PrefillSegment(row, s.num_tokens, s.start_pos, table))
            row += s.num_tokens
        return torch.tensor(tokens, dtype=torch.long, device=dev), meta

    def _prepare_decodes(self, decodes: list[ScheduledRequest], meta: AttentionMetadata) -> None:
        bs = self.block_size
        ctx_lens = [s.start_pos + 1 for s in decodes]
        width = max(-(-n // bs) for n in ctx_lens)
        table = [
            s.block_ids[:width] + [0] * (width - min(width, len(s.block_ids))) for s in decodes
        ]
        dev = self.device
        meta.num_decodes = len(decodes)
        meta.decode_block_table = torch.tensor(table, dtype=torch.long, device=dev)
        lens = torch.tensor(ctx_lens, dtype=torch.long, device=dev)
        mask = torch.arange(width * bs, device=dev)[None, :] < lens[:, None]  # [B, L]
        meta.decode_mask = mask[:, None, None, :]
