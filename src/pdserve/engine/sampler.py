"""Token selection: penalties and logit bias, greedy, temperature, top-k, top-p, per-request
seeds; top-N logprobs.

A seeded request draws its k-th output token from a generator seeded with (seed, k), so the draw
depends only on the seed, the position and the logits: not on which other requests share the
batch, and not on which worker samples it (P samples the first token, D the rest, and the result
is the colocated one). Penalties read the request's own token history, which both P and D hold.
Unseeded requests keep one generator each, seeded from the sampler's default seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from pdserve.engine.request import SamplingParams


@dataclass
class SampleResult:
    token_id: int
    # {token id: logprob} of the sampled token plus the top-N, when logprobs were asked for.
    logprobs: dict[int, float] | None = None


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's first index of its largest value (torch.argmax's answer, NaN counting as
    largest), through numpy: torch's CPU argmax over a vocabulary row is not vectorised (945 us
    for 8 x 49152 floats on one Xeon thread, against 54 us in numpy; about 4% of a batch-8
    decode step of the default model)."""
    return cast(list[int], logits.numpy().argmax(axis=-1).tolist())


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
        histories: Sequence[History] | None = None,
        masks: Sequence[torch.Tensor | None] | None = None,
    ) -> list[SampleResult]:
        """`histories[i]`: (prompt ids, output ids so far) of row i; needed for penalties and for
        the position a seeded draw is keyed on (taken as 0 without it). `masks[i]`: bool
        [vocab], the tokens a grammar allows row i (structured outputs), applied first: before
        penalties, temperature and top-k/p, so they only choose among allowed tokens."""
        logits = logits.float().cpu()
        greedy = argmax_rows(logits)
        results = []
        for row, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            history = histories[row] if histories is not None else ((), ())
            row_logits = logits[row]
            mask = masks[row] if masks is not None else None
            if mask is not None:
                row_logits = row_logits.masked_fill(~mask, float("-inf"))
            if p.penalized:
                row_logits = apply_penalties(row_logits, p, history)
            if p.penalized or mask is not None:
                token = int(row_logits.argmax()) if p.greedy else -1
            else:
                token = greedy[row]
            if not p.greedy:
                token = self._sample_row(row_logits, rid, p, len(history[1]))
            results.append(SampleResult(token, logprobs_of(row_logits, token, p.logprobs)))
        return results

    def _sample_row(self, logits: torch.Tensor, rid: str, p: SamplingParams, pos: int) -> int:
        probs = torch.softmax(filter_logits(logits / p.temperature, p.top_k, p.top_p), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator(rid, p, pos)).item())

    def generator(self, rid: str, p: SamplingParams, pos: int) -> torch.Generator:
        """The generator of output token `pos`'s draw (keyed on (seed, pos) when seeded)."""
        if p.seed is not None:
            return torch.Generator().manual_seed(position_seed(p.seed, pos))
        gen = self._generators.get(rid)
        if gen is None:
            seed = p.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._fallback).item())
            gen = self._generators[rid] = torch.Generator().manual_seed(seed)
        return gen


History = tuple[Sequence[int], Sequence[int]]  # (prompt ids, output ids so far)
_MASK64 = (1 << 64) - 1


def position_seed(seed: int, pos: int) -> int:
    """The seed of the draw for output token `pos` (splitmix64 of seed and position): distinct
    positions get unrelated streams, the same (seed, pos) the same stream on any worker."""
    z = (seed + (pos + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def apply_penalties(logits: torch.Tensor, p: SamplingParams, history: History) -> torch.Tensor:
    """logit_bias, then the repetition penalty (vLLM's: prompt and output tokens, positive logits
    divided, negative multiplied), then OpenAI's frequency/presence penalties (output tokens:
    minus frequency x count, minus presence once). Returns a new tensor."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    if p.logit_bias:
        ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([b for t, b in p.logit_bias.items() if t < vocab])
        logits.index_add_(0, ids, bias.to(logits.dtype))
    prompt, output = history
    if p.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(list(prompt) + list(output), dtype=torch.long).unique()
        vals = logits[seen]
        rp = p.repetition_penalty
        logits[seen] = torch.where(vals > 0, vals / rp, vals * rp)
    if (p.frequency_penalty or p.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(list(output), dtype=torch.long), minlength=vocab)
        counts = counts[:vocab].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
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


def logprobs_of(logits: torch.Tensor, token: int, n: int | None) -> dict[int, float] | None:
    if n is None:
        return None
    logp = torch.log_softmax(logits, dim=-1)
    out = {token: float(logp[token])}
    if n > 0:
        values, ids = torch.topk(logp, n)
        # a grammar's mask leaves -inf behind: not a number JSON can carry, nor a candidate
        out.update((i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True) if v > -1e30)
    return out
