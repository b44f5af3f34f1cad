"""Request streams for `pdserve bench serve`.

A workload is an iterable of `RequestItem`s: a prompt (token ids) and the number of tokens to
generate, plus the conversation it belongs to and its turn. The load generator sends the turns of
one conversation in order (turn t waits for turn t-1 to finish) and interleaves conversations;
items of different conversations are independent. Every workload is seeded. `synthetic` and
`multiturn` need no tokenizer: prompts are random token ids in [`ID_LOW`, `ID_HIGH`), sent as ids
or, for servers that reject token-id prompts, as one word per id (`ids_to_text`). `rag`
(`pdserve.workloads.rag`: questions about Python, each with BM25-retrieved passages of the language
reference filling the prompt to its target length) has real text, rendered with a tokenizer's
chat template and sent as `RequestItem.text`.

`mixed` interleaves short and long prompts (seeded, a configurable long fraction) with short
answers: the case for deciding per request where to prefill. `shifting` changes shape half-way:
phase 1 sends long prompts with short answers (prefill-bound), phase 2 short prompts with long
answers (decode-bound); the boundary is a request index (`--shift-at`) or a time into the run
(`--shift-at-s`: then the load generator asks the workload's `item_at(index, seconds since the
start)` which item to send). Items carry a `phase` label (shifting: its phase; mixed: short or
long) that reports split by.

`multiturn` carries each turn's *actual* answer into the next prompt by default
(`--multiturn-answers actual`): an item then holds only its new user message (`question`), and the
load generator sends previous prompt + the answer the server returned + that message; with
`placeholder` the answer is `max_tokens` random ids fixed in advance (prompts known up front).

Adding a workload: write a class with `name` and `__iter__` yielding `RequestItem`s, register a
factory in `WORKLOADS` and, for its own flags, an `add_arguments` in `WORKLOAD_ARGUMENTS`
(`add_arguments` here adds them all to `bench serve`; factories read them with `getattr` and a
default, so a namespace without them still works); import anything heavy inside the factory, so
that importing this module stays cheap.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from pdserve import argtypes
from pdserve.workloads.items import RequestItem, Workload, sample_lengths

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


def ids_to_text(ids: list[int]) -> str:
    """A deterministic word per id, so shared id prefixes stay shared text prefixes."""
    return " ".join(_WORDS[i % len(_WORDS)] for i in ids)


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
    """Conversations of `turns` turns (the last one may be shorter) adding up to `num_requests`;
    with `turns_range` (LO, HI) each conversation's turns are drawn uniform in [LO, HI], seeded;
    with `first_len` a conversation's first question has that mean length (a RAG-sized context)
    and later ones `input_len`.
    Items carry `phase` "turn 1" or "turns 2+" (reports split TTFT by them).

    Turn 0's prompt is a question; turn t's prompt is turn t-1's prompt + a placeholder for its
    answer (`max_tokens` random ids, as the real answer isn't known in advance) + a new question.
    So consecutive turns share a growing prefix, which a prefix cache can reuse. Question lengths
    follow `input_len`/`spread`, answer lengths `output_len`/`spread`.

    `answers="actual"`: each item also carries its new question (`RequestItem.question`), and the
    load generator replaces the placeholder by the answer the server actually returned (known
    once the previous turn finished; turns are sent in order), so the prompt extends exactly what
    the server computed before. The random ids drawn are the same in both modes.
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
        answers: str = "placeholder",
        turns_range: tuple[int, int] | None = None,
        first_len: int | None = None,
    ) -> None:
        if turns < 1:
            raise ValueError(f"turns must be >= 1, got {turns}")
        if answers not in MULTITURN_ANSWERS:
            raise ValueError(f"answers must be one of {MULTITURN_ANSWERS}, got {answers!r}")
        self.num_requests, self.turns = num_requests, turns
        rng = np.random.default_rng(seed)
        q_lens = sample_lengths(rng, input_len, spread, num_requests)
        a_lens = sample_lengths(rng, output_len, spread, num_requests)
        self._items: list[RequestItem] = []
        prompt: list[int] = []
        plan = _turn_plan(num_requests, turns, turns_range, seed)
        if first_len is not None:  # a long opening (RAG context), short follow-ups
            firsts = sample_lengths(np.random.default_rng([seed, 48]), first_len, spread, len(plan))
            q_lens = [f if t == 0 else q for f, q, (_, t) in zip(firsts, q_lens, plan, strict=True)]
        for i, (conv, turn) in enumerate(plan):
            # a new conversation, or the previous prompt + its answer's placeholder
            prompt = [] if turn == 0 else prompt + _random_ids(rng, self._items[-1].max_tokens)
            question = _random_ids(rng, q_lens[i])
            prompt = prompt + question
            self._items.append(
                RequestItem(
                    prompt,
                    a_lens[i],
                    conversation=conv,
                    turn=turn,
                    question=question if answers == "actual" else None,
                    phase="turn 1" if turn == 0 else "turns 2+",
                )
            )

    def __iter__(self) -> Iterator[RequestItem]:
        # conversation by conversation; the load generator interleaves them
        return iter(self._items)


MULTITURN_ANSWERS = ("actual", "placeholder")


def _turn_plan(
    n: int, turns: int, turns_range: tuple[int, int] | None, seed: int
) -> list[tuple[int, int]]:
    """(conversation, turn) of each of `n` items: `turns` per conversation, or a count drawn
    per conversation from `turns_range` (its own generator: the prompts' draws stay the same)."""
    if turns_range is None:
        return [divmod(i, turns) for i in range(n)]
    rng = np.random.default_rng([seed, 47])
    plan: list[tuple[int, int]] = []
    while len(plan) < n:
        conv = plan[-1][0] + 1 if plan else 0
        plan += [(conv, t) for t in range(sample_range(rng, turns_range, 1)[0])]
    return plan[:n]


def sample_range(rng: np.random.Generator, lo_hi: tuple[int, int], n: int) -> list[int]:
    """`n` integers uniform in [lo, hi] (both included)."""
    lo, hi = lo_hi
    if not 1 <= lo <= hi:
        raise ValueError(f"a length range needs 1 <= LO <= HI, got {lo},{hi}")
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


class MixedWorkload:
    """Independent requests, each short (prompt in `short_len`) or, with probability
    `long_fraction`, long (prompt in `long_len`); answers in `output_len` (short by default).
    Items carry `phase` "short" or "long"."""

    name = "mixed"

    def __init__(
        self,
        num_requests: int,
        seed: int,
        short_len: tuple[int, int] = (64, 200),
        long_len: tuple[int, int] = (1500, 2000),
        long_fraction: float = 0.25,
        output_len: tuple[int, int] = (16, 64),
    ) -> None:
        if not 0.0 <= long_fraction <= 1.0:
            raise ValueError(f"long fraction must be in [0, 1], got {long_fraction}")
        rng = np.random.default_rng(seed)
        is_long = rng.random(num_requests) < long_fraction
        shorts = sample_range(rng, short_len, num_requests)
        longs = sample_range(rng, long_len, num_requests)
        outs = sample_range(rng, output_len, num_requests)
        self._items = [
            RequestItem(
                _random_ids(rng, longs[i] if is_long[i] else shorts[i]),
                outs[i],
                conversation=i,
                phase="long" if is_long[i] else "short",
            )
            for i in range(num_requests)
        ]

    def __iter__(self) -> Iterator[RequestItem]:
        return iter(self._items)


PHASES = ("prefill-heavy", "decode-heavy")


class ShiftingWorkload:
    """Phase 1 ("prefill-heavy"): prompts in `phase1_input`, answers in `phase1_output` (long
    prompts, short answers); phase 2 ("decode-heavy"): `phase2_input`, `phase2_output` (short
    prompts, long answers). The boundary: request index `shift_at` (default: half-way), or, with
    `shift_at_s`, the time into the run (requests sent before it are phase 1, `item_at`).

    Both variants of every index are drawn up front from one seeded generator, so the items are
    the same whatever the boundary; request i is conversation i in either phase."""

    name = "shifting"

    def __init__(
        self,
        num_requests: int,
        seed: int,
        phase1_input: tuple[int, int] = (1500, 2000),
        phase1_output: tuple[int, int] = (8, 16),
        phase2_input: tuple[int, int] = (64, 128),
        phase2_output: tuple[int, int] = (128, 192),
        shift_at: int | None = None,
        shift_at_s: float | None = None,
    ) -> None:
        if shift_at is not None and not 0 <= shift_at <= num_requests:
            raise ValueError(f"shift-at must be in [0, {num_requests}], got {shift_at}")
        if shift_at_s is not None and not shift_at_s >= 0:
            raise ValueError(f"shift-at-s must be >= 0, got {shift_at_s}")
        self.num_requests = num_requests
        self.shift_at = num_requests // 2 if shift_at is None else shift_at
        self.shift_at_s = shift_at_s
        rng = np.random.default_rng(seed)
        lens = [
            sample_range(rng, r, num_requests)
            for r in (phase1_input, phase1_output, phase2_input, phase2_output)
        ]
        self._variants = [
            tuple(
                RequestItem(_random_ids(rng, lens[2 * p][i]), lens[2 * p + 1][i], i, phase=name)
                for p, name in enumerate(PHASES)
            )
            for i in range(num_requests)
        ]
        # with a time boundary the load generator asks which item to send (else it iterates)
        self.item_at: Callable[[int, float], RequestItem] | None = (
            self._item_at_time if shift_at_s is not None else None
        )

    def _item_at_time(self, index: int, elapsed_s: float) -> RequestItem:
        assert self.shift_at_s is not None
        return self._variants[index][0 if elapsed_s < self.shift_at_s else 1]

    def __iter__(self) -> Iterator[RequestItem]:
        # by index (with a time boundary: what an instant run would send, for counting only)
        for i, variants in enumerate(self._variants):
            yield variants[0 if i < self.shift_at else 1]


class WorkloadSpec(Protocol):
    """What the factories read of a run's spec (workloads/spec.py `LoadSpec`); a workload's
    own settings are read with getattr and their flags' defaults."""

    @property
    def workload(self) -> str: ...
    @property
    def num_requests(self) -> int: ...
    @property
    def input_len(self) -> int: ...
    @property
    def output_len(self) -> int: ...
    @property
    def len_spread(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def turns(self) -> int: ...


def _synthetic(args: WorkloadSpec) -> Workload:
    return SyntheticWorkload(
        args.num_requests, args.input_len, args.output_len, args.len_spread, args.seed
    )


def _multiturn(args: WorkloadSpec) -> Workload:
    return MultiTurnWorkload(
        args.num_requests,
        args.input_len,
        args.output_len,
        args.len_spread,
        args.seed,
        args.turns,
        answers=getattr(args, "multiturn_answers", "actual"),
        turns_range=getattr(args, "turns_range", None),
        first_len=getattr(args, "first_len", None),
    )


def _mixed(args: WorkloadSpec) -> Workload:
    return MixedWorkload(
        args.num_requests,
        args.seed,
        short_len=getattr(args, "short_len", (64, 200)),
        long_len=getattr(args, "long_len", (1500, 2000)),
        long_fraction=getattr(args, "long_fraction", 0.25),
        output_len=getattr(args, "mixed_output_len", (16, 64)),
    )


def _shifting(args: WorkloadSpec) -> Workload:
    return ShiftingWorkload(
        args.num_requests,
        args.seed,
        phase1_input=getattr(args, "phase1_input_len", (1500, 2000)),
        phase1_output=getattr(args, "phase1_output_len", (8, 16)),
        phase2_input=getattr(args, "phase2_input_len", (64, 128)),
        phase2_output=getattr(args, "phase2_output_len", (128, 192)),
        shift_at=getattr(args, "shift_at", None),
        shift_at_s=getattr(args, "shift_at_s", None),
    )


def _rag(args: WorkloadSpec) -> Workload:
    # lazy: the tokenizer, bm25s and the knowledge base are only needed for this workload
    from pdserve.engine.loader import load_tokenizer, resolve_model
    from pdserve.workloads.rag import RagWorkload

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
WORKLOADS: dict[str, Callable[[WorkloadSpec], Workload]] = {
    "synthetic": _synthetic,
    "multiturn": _multiturn,
    "rag": _rag,
    "mixed": _mixed,
    "shifting": _shifting,
}


# ---------------------------------------------------------------------------- workload flags


def length_range(text: str) -> tuple[int, int]:
    """argparse type of a length range 'LO,HI' (tokens, 1 <= LO <= HI); 'N' means N,N."""
    parts = [p.strip() for p in text.split(",")]
    try:
        lo, hi = int(parts[0]), int(parts[-1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (integers), got {text!r}") from None
    if len(parts) > 2 or not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def _multiturn_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multiturn workload")
    group.add_argument(
        "--multiturn-answers",
        choices=MULTITURN_ANSWERS,
        default="actual",
        help="what a turn's prompt carries of the previous answer: the text the server returned "
        "(ids prompts: re-tokenized with --tokenizer) or max_tokens random ids fixed in advance",
    )
    group.add_argument(
        "--turns-range",
        type=length_range,
        default=None,
        help="LO,HI: each conversation's turns drawn uniform in [LO, HI] (seeded), instead of "
        "--turns",
    )
    group.add_argument(
        "--first-len",
        type=argtypes.positive_int,
        default=None,
        help="mean length of a conversation's first question (e.g. a RAG context); later "
        "questions: --input-len",
    )


def _mixed_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mixed workload")
    group.add_argument("--short-len", type=length_range, default=(64, 200), help="LO,HI tokens")
    group.add_argument("--long-len", type=length_range, default=(1500, 2000), help="LO,HI tokens")
    group.add_argument(
        "--long-fraction", type=argtypes.fraction, default=0.25, help="share of long prompts"
    )
    group.add_argument(
        "--mixed-output-len", type=length_range, default=(16, 64), help="LO,HI max_tokens"
    )


def _shifting_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("shifting workload")
    for phase, what, default in (
        (1, "input", (1500, 2000)),
        (1, "output", (8, 16)),
        (2, "input", (64, 128)),
        (2, "output", (128, 192)),
    ):
        group.add_argument(
            f"--phase{phase}-{what}-len",
            type=length_range,
            default=default,
            help=f"LO,HI {'prompt tokens' if what == 'input' else 'max_tokens'} in phase {phase}",
        )
    boundary = group.add_mutually_exclusive_group()
    boundary.add_argument(
        "--shift-at",
        type=argtypes.non_negative_int,
        default=None,
        help="first phase-2 request index (default: num_requests // 2)",
    )
    boundary.add_argument(
        "--shift-at-s",
        type=argtypes.non_negative_float,
        default=None,
        help="seconds into the run from which requests are phase 2 (instead of --shift-at)",
    )


# name -> the flags of that workload (added to `bench serve` by `add_arguments`)
WORKLOAD_ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "multiturn": _multiturn_arguments,
    "mixed": _mixed_arguments,
    "shifting": _shifting_arguments,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every registered workload's own flags."""
    for add in WORKLOAD_ARGUMENTS.values():
        add(parser)


def make_workload(args: WorkloadSpec) -> Workload:
    try:
        factory = WORKLOADS[args.workload]
    except KeyError:
        raise ValueError(
            f"unknown workload {args.workload!r}; known: {sorted(WORKLOADS)}"
        ) from None
    return factory(args)
