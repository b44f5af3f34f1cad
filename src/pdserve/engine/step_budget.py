"""How many prompt tokens may join a step's decodes so the step stays within the TPOT SLO.

Stall-free batching (Sarathi-Serve): a colocated worker (and a decode worker that prefills
locally) runs its decodes every step and fills the rest of the step with prompt tokens only up
to the time the TPOT SLO leaves. The scheduler stays pure: it calls the function built here with
plain numbers. Pure arithmetic over a cost model (costmodel/model.py's `CostModel`, anything with
the same two methods), no engine state.

A mixed step is modelled as the decode step plus the marginal cost of its prompt tokens:
    decode_step_s(B, L) + prefill_s(n, cached) - prefill_s(0, 0) <= tpot_s
(the fixed part of a prefill — reading the weights — is already paid by the decode step).
`cached` is the KV the chunk attends to: on the AMD EPYC Zen 4 (2 threads) a 16-token chunk
after 2000 cached tokens costs about twice one at 0, so pricing every chunk from 0 let steps run
2-3x past the SLO deep into a long prompt. At least `min_tokens` prompt tokens are always
allowed, so prompts progress even when the decodes alone fill the SLO; the default is one token,
which keeps that overshoot to a single token's cost (decode priority: prompts take what the
decodes leave).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdserve.engine.scheduler import SchedulerOutput

MIN_PREFILL_TOKENS = 1


class StepCost(Protocol):
    def prefill_s(self, new: int, cached: int = 0) -> float: ...

    def decode_step_s(self, batch: int, context: int) -> float: ...


class StallFreeBudget:
    """The budget function, which also learns how far the cost model is off right now.

    `observe` (called by the engine after each step that ran decodes) keeps a moving average of
    measured / predicted step time, clamped to [1/4, 8]; the budget divides the SLO by it. So a
    model fitted on a quieter machine (or a slower one) stops overfilling steps after a few.
    """

    def __init__(
        self, cost: StepCost, tpot_s: float, max_tokens: int, min_tokens: int, smoothing: float
    ) -> None:
        if tpot_s <= 0:
            raise ValueError(f"the TPOT SLO must be > 0 seconds, got {tpot_s}")
        if not 1 <= min_tokens <= max_tokens:
            raise ValueError(f"need 1 <= min_tokens ({min_tokens}) <= max_tokens ({max_tokens})")
        self.cost, self.tpot_s = cost, tpot_s
        self.max_tokens, self.min_tokens, self.smoothing = max_tokens, min_tokens, smoothing
        self.base = cost.prefill_s(0, 0)
        self.ratio = 1.0  # measured / predicted step time, smoothed

    def predict_s(self, batch: int, context: int, prompt_tokens: int, cached: int = 0) -> float:
        extra = self.cost.prefill_s(prompt_tokens, cached) - self.base if prompt_tokens else 0.0
        return self.cost.decode_step_s(batch, context) + extra

    def observe(
        self, batch: int, context: int, prompt_tokens: int, seconds: float, cached: int = 0
    ) -> None:
        predicted = self.predict_s(batch, context, prompt_tokens, cached)
        if batch < 1 or predicted <= 0 or seconds <= 0:
            return
        r = min(8.0, max(0.25, seconds / predicted))
        self.ratio += self.smoothing * (r - self.ratio)

    def __call__(self, batch: int, context: int, cached: int = 0) -> int:
        lo, hi = self.min_tokens, self.max_tokens  # step time grows with n: binary search
        if self._fits(batch, context, cached, hi):
            return hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(batch, context, cached, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _fits(self, batch: int, context: int, cached: int, n: int) -> bool:
        return self.ratio * self.predict_s(batch, context, n, cached) <= self.tpot_s


def tpot_prefill_budget(
    cost: StepCost,
    tpot_s: float,
    max_tokens: int,
    min_tokens: int = MIN_PREFILL_TOKENS,
    smoothing: float = 0.2,
) -> StallFreeBudget:
    """(decodes, their context tokens, the next chunk's cached tokens) -> prompt tokens allowed
    with them this step."""
    return StallFreeBudget(cost, tpot_s, max_tokens, min_tokens, smoothing)


def observe_step(
    budget: Callable[[int, int, int], int] | None, out: SchedulerOutput, seconds: float
) -> None:
    """Teach a stall-free budget how long a step with these decodes really took. A decode's
    draft tokens (speculation) are priced as prompt tokens over its context: the verify rows
    cost what a short chunk there costs."""
    if not isinstance(budget, StallFreeBudget):
        return
    decodes = [s for s in out.scheduled if s.num_tokens - s.num_draft == 1]
    chunks = [s for s in out.scheduled if s.num_tokens - s.num_draft > 1]
    context = sum(s.start_pos + 1 for s in decodes)
    drafts = [(s.num_draft, s.start_pos + 1) for s in decodes if s.num_draft]
    pieces = [(s.num_tokens, s.start_pos) for s in chunks] + drafts
    prompt = sum(n for n, _ in pieces)
    # Several chunks are priced as one of their summed size at their token-weighted cached
    # prefix (a slight over-estimate of the attention term).
    cached = sum(n * start for n, start in pieces) // max(1, prompt)
    budget.observe(len(decodes), context, prompt, seconds, cached)
