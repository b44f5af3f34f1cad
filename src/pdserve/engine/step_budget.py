"""How many prompt tokens may join a step's decodes so the step stays within the TPOT SLO.

Stall-free batching (Sarathi-Serve): a colocated worker (and a decode worker that prefills
locally) runs its decodes every step and fills the rest of the step with prompt tokens only up
to the time the TPOT SLO leaves. The scheduler stays pure: it calls the function built here with
plain numbers. Pure arithmetic over a cost model (costmodel/model.py's `CostModel`, anything with
the same two methods), no engine state.

A mixed step is modelled as the decode step plus the marginal cost of its prompt tokens:
    decode_step_s(B, L) + prefill_s(n, 0) - prefill_s(0, 0) <= tpot_s
(the fixed part of a prefill — reading the weights — is already paid by the decode step; the
cached prefix of a chunk is not known here, so it is taken as 0). At least `min_tokens` prompt
tokens are always allowed, so prompts progress even when the decodes alone exceed the SLO.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

MIN_PREFILL_TOKENS = 16


class StepCost(Protocol):
    def prefill_s(self, new: int, cached: int = 0) -> float: ...

    def decode_step_s(self, batch: int, context: int) -> float: ...


def tpot_prefill_budget(
    cost: StepCost, tpot_s: float, max_tokens: int, min_tokens: int = MIN_PREFILL_TOKENS
) -> Callable[[int, int], int]:
    """(decodes, their context tokens) -> prompt tokens allowed with them this step."""
    if tpot_s <= 0:
        raise ValueError(f"the TPOT SLO must be > 0 seconds, got {tpot_s}")
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens ({min_tokens}) <= max_tokens ({max_tokens})")
    base = cost.prefill_s(0, 0)

    def fits(batch: int, context: int, n: int) -> bool:
        return cost.decode_step_s(batch, context) + cost.prefill_s(n, 0) - base <= tpot_s

    def budget(batch: int, context: int) -> int:
        lo, hi = min_tokens, max_tokens  # the step time grows with n: binary search
        if fits(batch, context, hi):
            return hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(batch, context, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    return budget
