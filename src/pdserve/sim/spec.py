"""The simulator's model of speculative decoding (prompt-lookup drafts verified on D): pure.

A speculating sequence's decode step carries its last token and `k` draft tokens, verified in
one forward pass on the decode path: the step model prices it as 1 + k decode rows, draft j a
query token over the sequence's context + j (on this host's cost model: a decode step of k more
rows and their context; prompt chunks are priced apart, by the prefill terms), and it yields
1 + `accepted` tokens. Each draft token is accepted with
probability `acceptance` (an input: what `pdserve serve` measures as its acceptance rate), and
drafting stops at the first rejection, so accepted tokens follow a truncated geometric law:

    E[accepted] = sum_{i=1..k} a^i = a (1 - a^k) / (1 - a)

`draw="sampled"` draws each step's count from the simulation's seeded RNG; `draw="expected"`
gives every request E[accepted] per step on average without noise (a per-request credit: each
step adds the expectation and yields its whole part). A sequence drafts at most one token fewer
than it has left to generate (`drafts`). Only decode rows speculate (on D and colocated
workers); a prompt's first token is the prefill's, as in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DRAWS = ("sampled", "expected")


@dataclass(frozen=True)
class SpecModel:
    tokens: int  # drafts per step (k)
    acceptance: float  # per draft token, in [0, 1]
    draw: str = "sampled"
    seed: int = 0
    # the engine's DraftPacer caps each step's drafts from the step model's price of verify
    # rows and the acceptance seen so far (engine/spec/pacing.py), as `pdserve serve` does;
    # False: every decode drafts `tokens` (the cases computed by hand)
    paced: bool = False

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"spec tokens must be >= 1, got {self.tokens}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"spec acceptance must be in [0, 1], got {self.acceptance}")
        if self.draw not in DRAWS:
            raise ValueError(f"spec draw must be one of {DRAWS}, got {self.draw!r}")

    def drafts(self, left: int) -> int:
        """Draft tokens for a sequence with `left` tokens still to generate (>= 1)."""
        return max(0, min(self.tokens, left - 1))


def expected_accepted(k: int, a: float) -> float:
    """E[accepted drafts] of `k` drafts each accepted with probability `a` until a rejection."""
    return float(k) if a >= 1.0 else a * (1.0 - a**k) / (1.0 - a)


class SpecDraws:
    """How many of a step's drafts each sequence accepts (one per simulation: seeded)."""

    def __init__(self, model: SpecModel) -> None:
        self.model = model
        self._rng = np.random.default_rng(model.seed + 104729)
        self._credit: dict[str, float] = {}

    def accepted(self, rid: str, drafts: int) -> int:
        if drafts <= 0:
            return 0
        a = self.model.acceptance
        if self.model.draw == "expected":
            credit = self._credit.get(rid, 0.0) + expected_accepted(drafts, a)
            whole = min(drafts, int(credit + 1e-9))
            self._credit[rid] = credit - whole
            return whole
        n = 0
        while n < drafts and self._rng.random() < a:
            n += 1
        return n

    def forget(self, rid: str) -> None:
        self._credit.pop(rid, None)
