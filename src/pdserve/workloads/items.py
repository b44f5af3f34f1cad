"""The vocabulary of request streams: one `RequestItem` (a prompt and how many tokens to
generate, in a conversation), the `Workload` protocol (an iterable of them), and `sample_lengths`,
which every seeded workload draws its lengths with. streams.py has the workloads and their
registry; rag.py, the one with real text, builds on this module alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class RequestItem:
    prompt: list[int]
    max_tokens: int
    conversation: int  # items of one conversation are sent in order, one at a time
    turn: int = 0
    # the prompt as text, when the workload has real text (rag): sent instead of `prompt`, which
    # then holds its token ids under the workload's tokenizer (for lengths and reports)
    text: str | None = None
    # multiturn with actual answers: this turn's new user message; the load generator sends the
    # previous turn's prompt + its actual answer + this (turn 0: this alone). `prompt` then holds
    # the placeholder form (same lengths, answer unknown in advance), for reports only
    question: list[int] | None = None
    # a label reports split by (shifting: "prefill-heavy" / "decode-heavy"; mixed: short / long)
    phase: str | None = None


@runtime_checkable
class Workload(Protocol):
    name: str

    def __iter__(self) -> Iterator[RequestItem]: ...


def sample_lengths(rng: np.random.Generator, mean: int, spread: float, n: int) -> list[int]:
    """`n` lengths uniform in [mean * (1 - spread), mean * (1 + spread)], each at least 1."""
    if not 0.0 <= spread <= 1.0:
        raise ValueError(f"length spread must be in [0, 1], got {spread}")
    if mean < 1:
        raise ValueError(f"mean length must be >= 1, got {mean}")
    lo, hi = mean * (1.0 - spread), mean * (1.0 + spread)
    return [max(1, round(x)) for x in rng.uniform(lo, hi, size=n)]
