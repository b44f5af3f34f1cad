"""Request streams for `pdserve bench serve`.

A workload is an iterable of `RequestItem`s: a prompt (token ids) and the number of tokens to
generate, plus the conversation it belongs to and its turn. The load generator sends the turns of
one conversation in order (turn t waits for turn t-1 to finish) and interleaves conversations;
items of different conversations are independent. Every workload is seeded. `synthetic` and
`multiturn` need no tokenizer: prompts are random token ids in [`ID_LOW`, `ID_HIGH`), sent as ids
or, for servers that reject token-id prompts, as one word per id (`ids_to_text`). `rag`
(`pdserve.bench.rag`: questions about Python, each with BM25-retrieved passages of the language
reference filling the prompt to its target length) has real text, rendered with a tokenizer's
chat template and sent as `RequestItem.text`.

Adding a workload: write a class with `name` and `__iter__` yielding `RequestItem`s, and register
a factory in `WORKLOADS` (its `add_arguments`, if any, goes into `serve_bench.add_arguments`);
import anything heavy inside the factory, so that importing this module stays cheap.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

ID_LOW, ID_HIGH = 1000, 30000  # token ids of synthetic prompts: clear of special/byte tokens

# one word per token id for `--prompt-format text`: short common words, mostly one token each
_WORD_TEXT = (
    "the of and to in is was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my "
    "over know water than call first who may down side been now find any new work part take get "
    "place made live where after back little only round man year came show every good me give our"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class RequestItem:
    prompt: list[int]
    max_tokens: int
    conversation: int  # items of one conversation are sent in order, one at a time
    turn: int = 0
    # the prompt as text, when the workload has real text (rag): sent instead of `prompt`, which
    # then holds its token ids under the workload's tokenizer (for lengths and reports)
    text: str | None = None


@runtime_checkable
class Workload(Protocol):
    name: str

    def __iter__(self) -> Iterator[RequestItem]: ...


def ids_to_text(ids: list[int]) -> str:
    """A deterministic word per id, so shared id prefixes stay shared text prefixes."""
    return " ".join(_WORDS[i % len(_WORDS)] for i in ids)


def sample_lengths(rng: np.random.Generator, mean: int, spread: float, n: int) -> list[int]:
    """`n` lengths uniform in [mean * (1 - spread), mean * (1 + spread)], each at least 1."""
    if not 0.0 <= spread <= 1.0:
        raise ValueError(f"length spread must be in [0, 1], got {spread}")
    if mean < 1:
        raise ValueError(f"mean length must be >= 1, got {mean}")
    lo, hi = mean * (1.0 - spread), mean * (1.0 + spread)
    return [max(1, round(x)) for x in rng.uniform(lo, hi, size=n)]


def _random_ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.integers(ID_LOW, ID_HIGH, size=n)]


class SyntheticWorkload:
    """`num_requests` independent prompts of random ids, lengths around the given means."""

    name = "synthetic"

    def __init__(
        self, num_requests: int, input_len: int, output_len: int, spread: float, seed: int
    ) -> None:
        self.num_requests = num_requests
        rng = np.random.default_rng(seed)
        self._in = sample_lengths(rng, input_len, spread, num_requests)
        self._out = sample_lengths(rng, output_len, spread, num_requests)
        self._prompts = [_random_ids(rng, n) for n in self._in]

    def __iter__(self) -> Iterator[RequestItem]:
        for i, (prompt, out) in enumerate(zip(self._prompts, self._out, strict=True)):
            yield RequestItem(prompt, out, conversation=i)


class MultiTurnWorkload:
    """Conversations of `turns` turns (the last one may be shorter) adding up to `num_requests`.

    Turn 0's prompt is a question; turn t's prompt is turn t-1's prompt + a placeholder for its
    answer (`max_tokens` random ids, as the real answer isn't known in advance) + a new question.
    So consecutive turns share a growing prefix, which a prefix cache can reuse. Question lengths
    follow `input_len`/`spread`, answer lengths `output_len`/`spread`.
    """

    name = "multiturn"

    def __init__(
        self,
        num_requests: int,
        input_len: int,
        output_len: int,
        spread: float,
        seed: int,
        turns: int,
    ) -> None:
        if turns < 1:
            raise ValueError(f"turns must be >= 1, got {turns}")
        self.num_requests, self.turns = num_requests, turns
        rng = np.random.default_rng(seed)
        q_lens = sample_lengths(rng, input_len, spread, num_requests)
        a_lens = sample_lengths(rng, output_len, spread, num_requests)
        self._items: list[RequestItem] = []
        prompt: list[int] = []
        for i in range(num_requests):
            conv, turn = divmod(i, turns)
            # a new conversation, or the previous prompt + its answer's placeholder
            prompt = [] if turn == 0 else prompt + _random_ids(rng, self._items[-1].max_tokens)
            prompt = prompt + _random_ids(rng, q_lens[i])
            self._items.append(RequestItem(prompt, a_lens[i], conversation=conv, turn=turn))

    def __iter__(self) -> Iterator[RequestItem]:
        # conversation by conversation; the load generator interleaves them
        return iter(self._items)


def _synthetic(args: argparse.Namespace) -> Workload:
    return SyntheticWorkload(
        args.num_requests, args.input_len, args.output_len, args.len_spread, args.seed
    )


def _multiturn(args: argparse.Namespace) -> Workload:
    return MultiTurnWorkload(
        args.num_requests, args.input_len, args.output_len, args.len_spread, args.seed, args.turns
    )


def _rag(args: argparse.Namespace) -> Workload:
    # lazy: the tokenizer, bm25s and the knowledge base are only needed for this workload
    from pdserve.bench.rag import RagWorkload
    from pdserve.engine.loader import load_tokenizer, resolve_model

    # the tokenizer whose chat template renders the prompts and whose ids measure them: the
    # served model's (`--tokenizer`), else the default model's
    tokenizer = load_tokenizer(resolve_model(getattr(args, "tokenizer", None)))
    return RagWorkload(
        args.num_requests,
        args.input_len,
        args.output_len,
        args.len_spread,
        args.seed,
        tokenizer,
    )


# name -> factory from the parsed `bench serve` flags
WORKLOADS: dict[str, Callable[[argparse.Namespace], Workload]] = {
    "synthetic": _synthetic,
    "multiturn": _multiturn,
    "rag": _rag,
}


def make_workload(args: argparse.Namespace) -> Workload:
    try:
        factory = WORKLOADS[args.workload]
    except KeyError:
        raise ValueError(
            f"unknown workload {args.workload!r}; known: {sorted(WORKLOADS)}"
        ) from None
    return factory(args)
