"""Prompt-lookup drafting: the tokens that followed the sequence's longest suffix n-gram where
it occurred before (prompt and generated tokens), as in vLLM's ngram proposer. Pure numpy.

`DraftState` keeps a request's tokens as a growing numpy array (appended, never rebuilt) and
its draft length, adapted to how many of its drafts were accepted: an exponential moving
average of the accepted fraction scales `num_speculative_tokens` down when drafts are rejected
and back up when they are accepted; at zero it recovers a little each step without drafts, so
a request whose text turns repetitive later is probed again.

`match` also says how long the matched context is (the n-gram, extended backwards up to
`MATCH_SPAN` tokens while the earlier occurrence agrees): how likely the drafts are, which
`pdserve bench spec-drafts` tabulates (bench/spec_drafts.py).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

EMA_WEIGHT = 0.5  # of the newest step's accepted fraction
EMA_RECOVERY = 0.1  # added to the average per step spent without drafting
MATCH_SPAN = 16  # longest context a match is measured over


def propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Up to `k` tokens following the latest earlier occurrence of the longest suffix n-gram
    (n from `n_max` down to `n_min`) of `tokens`; empty when none occurs."""
    found = _latest(tokens, k, n_min, n_max)
    return tokens[:0] if found is None else tokens[found[0] + found[1] :][:k]


def match(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> tuple[np.ndarray, int]:
    """`propose`'s drafts and the length of the context they were matched on: the n-gram's n,
    extended backwards while the tokens before both occurrences agree, at most `MATCH_SPAN`
    (0: no drafts). Measuring the span is the bench's (spec_drafts.py), not the serving path's."""
    found = _latest(tokens, k, n_min, n_max)
    if found is None:
        return tokens[:0], 0
    hit, n = found
    size, span = len(tokens), n
    while span < MATCH_SPAN and hit + n - span > 0:
        if tokens[hit + n - span - 1] != tokens[size - span - 1]:
            break
        span += 1
    return tokens[hit + n : hit + n + k], span


def _latest(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> tuple[int, int] | None:
    """(start, n) of the latest earlier occurrence of the longest suffix n-gram, or None."""
    size = len(tokens)
    if k < 1:
        return None
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n :]
        # windows starting at 0 .. size - n - 1: every occurrence but the suffix itself
        windows = sliding_window_view(tokens[: size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            return int(hits[-1]), n  # the most recent occurrence: nearest in topic
    return None


class DraftState:
    """One request's tokens (numpy) and adaptive draft length."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self.tokens = np.empty(256, dtype=np.int64)
        self.size = 0
        self.acceptance = 1.0  # moving average of the accepted fraction of its drafts

    def sync(self, prompt: list[int], output: list[int]) -> np.ndarray:
        """The sequence's tokens now (appends what arrived since the last call)."""
        total = len(prompt) + len(output)
        if total < self.size:  # a stop string cut accepted tokens: start over
            self.size = 0
        if total > len(self.tokens):
            grown = np.empty(max(total, 2 * len(self.tokens)), dtype=np.int64)
            grown[: self.size] = self.tokens[: self.size]
            self.tokens = grown
        if self.size < len(prompt):
            self.tokens[self.size : len(prompt)] = prompt[self.size :]
            self.size = len(prompt)
        start = self.size - len(prompt)
        self.tokens[self.size : total] = output[start:]
        self.size = total
        return self.tokens[:total]

    @property
    def k(self) -> int:
        """Drafts to propose next: `max_k` scaled by the acceptance average, in [0, max_k]."""
        return min(self.max_k, round(self.max_k * self.acceptance))

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            frac = accepted / drafted
            self.acceptance = (1 - EMA_WEIGHT) * self.acceptance + EMA_WEIGHT * frac
        else:
            self.acceptance = min(1.0, self.acceptance + EMA_RECOVERY)
