"""Verifying drafts against the target model's logits of one forward pass.

A request with k drafts d_1..d_k was computed as the rows of its last token and its drafts, so
row j holds the model's logits for the token after d_j (row 0: after the last real token).
Row j is processed as the sampler processes a decode row (penalties over the history with the
drafts before it, temperature, top-k, top-p), then:
  * greedy: d_{j+1} is accepted while it equals the row's argmax; the argmax at the first
    mismatch (or after the last draft: the bonus token) ends the step: exactly the tokens
    decoding without drafts would produce.
  * sampling: a draft is one token with probability 1 (a point mass q), so rejection sampling
    accepts d with probability min(1, p(d) / q(d)) = p(d), and on rejection draws from
    p with d removed, renormalised (max(0, p - q)). Every position's token is then distributed
    exactly as p (P(d) = p(d); P(y != d) = (1 - p(d)) p(y) / (1 - p(d))).
A seeded request draws position t's uniform and residual from the generator of (seed, t), so
its output is reproducible (though not the output without speculation, which draws once).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from pdserve.engine.request import SamplingParams
from pdserve.engine.sampler import Sampler, apply_penalties, filter_logits, logprobs_of

Sample = tuple[int, dict[int, float] | None]


def accept_point_mass(probs: torch.Tensor, draft: int, gen: torch.Generator) -> int:
    """`draft` with probability probs[draft], else a draw from probs without it."""
    u = float(torch.rand((), generator=gen))
    p_draft = float(probs[draft])
    if u < p_draft:
        return draft
    residual = probs.clone()
    residual[draft] = 0.0
    if not float(residual.sum()) > 0:  # p(draft) == 1 up to rounding: nothing else to draw
        return draft
    return int(torch.multinomial(residual, 1, generator=gen).item())


def verify(
    sampler: Sampler,
    request_id: str,
    params: SamplingParams,
    history: tuple[Sequence[int], Sequence[int]],
    drafts: Sequence[int],
    rows: torch.Tensor,  # [1 + len(drafts), vocab]
    stops: Collection[int] = (),
) -> list[Sample]:
    """The tokens this step yields: the accepted drafts and one more (a correction or the
    bonus token), each with its logprobs from the target row it was chosen from; none after
    a token of `stops` (EOS, stop_token_ids), which ends the request there."""
    prompt, output = history
    out: list[Sample] = []
    for j in range(len(drafts) + 1):
        seen = [*output, *drafts[:j]]
        logits = rows[j].float()
        if params.penalized:
            logits = apply_penalties(logits, params, (prompt, seen))
        if params.greedy:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(
                filter_logits(logits / params.temperature, params.top_k, params.top_p), dim=-1
            )
            gen = sampler.generator(request_id, params, len(seen))
            if j < len(drafts):
                token = accept_point_mass(probs, drafts[j], gen)
            else:
                token = int(torch.multinomial(probs, 1, generator=gen).item())
        out.append((token, logprobs_of(logits, token, params.logprobs)))
        if j == len(drafts) or token != drafts[j] or token in stops:
            break
    return out
