"""Token selection: greedy, temperature, top-k, top-p, per-request seeds; top-N logprobs.

Each seeded request owns a `torch.Generator`, so its samples depend only on its seed and its
own logits, not on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.request import SamplingParams


@dataclass
class SampleResult:
    token_id: int
    # {token id: logprob} of the sampled token plus the top-N, when logprobs were asked for.
    logprobs: dict[int, float] | None = None


class Sampler:
    def __init__(self, default_seed: int = 0) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._fallback = torch.Generator().manual_seed(default_seed)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(
        self,
        logits: torch.Tensor,  # [S, vocab] float32, one row per request to sample
        request_ids: list[str],
        params: list[SamplingParams],
    ) -> list[SampleResult]:
        logits = logits.float().cpu()
        greedy = logits.argmax(dim=-1).tolist()
        results = []
        for row, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            token = greedy[row] if p.greedy else self._sample_row(logits[row], rid, p)
            results.append(SampleResult(token, _logprobs(logits[row], token, p.logprobs)))
        return results

    def _sample_row(self, logits: torch.Tensor, rid: str, p: SamplingParams) -> int:
        probs = torch.softmax(_filter(logits / p.temperature, p.top_k, p.top_p), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator(rid, p)).item())

    def _generator(self, rid: str, p: SamplingParams) -> torch.Generator:
        gen = self._generators.get(rid)
        if gen is None:
            seed = p.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._fallback).item())
            gen = self._generators[rid] = torch.Generator().manual_seed(seed)
        return gen


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask everything outside the top-k and outside the smallest set with mass >= top_p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def _logprobs(logits: torch.Tensor, token: int, n: int | None) -> dict[int, float] | None:
    if n is None:
        return None
    logp = torch.log_softmax(logits, dim=-1)
    out = {token: float(logp[token])}
    if n > 0:
        values, ids = torch.topk(logp, n)
        out.update(zip(ids.tolist(), values.tolist(), strict=True))
    return out
