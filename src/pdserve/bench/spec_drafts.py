"""`pdserve bench spec-drafts`: what prompt-lookup drafts on this model's answers can yield,
apart from any timing: the accepted drafts by how long the matched context is, and the tokens
per unit of step time that pacing them could reach at a given cost of a verify row.

Method. One engine (`--model`, `--threads`) writes greedy answers (`ignore_eos`, as the
benchmarks send them) to `--num-requests` RAG-small prompts (`--input-len`, `--output-len`).
Then, offline, at every answer position: the drafts `ngram.match` proposes there (up to `-k`,
with the serve defaults' prompt_lookup_min / max) against the tokens the model went on to write.
Reported, for each verify row cost r in `--row-cost` (a draft row's time over a plain step's:
`(verify / plain - 1) / k` from `pdserve bench spec-crossover` at batch 1):

  * per match length class (`SPANS`: 1, 2, 3, 4-5, 6-8, 9+ tokens of agreeing context): how
    many positions, and the chance that drafts 1..k are accepted up to each;
  * `fixed k`: each answer walked step by step, every step drafting k (what is proposed of it),
    yielding 1 + the accepted drafts at a cost of 1 + r x drafted: tokens per plain step's time;
  * `by class`: the best k per match length class, chosen from the table above (on the same
    answers: a bound on a pacer that learns the table while serving);
  * `oracle`: each step drafts exactly as many as will be accepted (the bound of any pacing of
    these drafts).

TPOT against decoding without drafts is 1 / (tokens per step's time).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.engine.spec import ngram
from pdserve.spec_config import SpeculativeConfig

SPANS = (1, 2, 3, 4, 6, 9)  # class i: matches of at least SPANS[i] tokens (below the next)


@dataclass(frozen=True)
class Position:
    """One answer position: the drafts proposed there and how many of them the answer took."""

    span: int  # tokens of agreeing context (0: nothing proposed)
    drafted: int
    accepted: int


def span_class(span: int) -> int:
    """The class of a match of `span` >= 1 tokens."""
    return sum(span >= s for s in SPANS) - 1


def positions(
    prompt: Sequence[int], answer: Sequence[int], k: int, lo: int, hi: int
) -> list[Position]:
    """Every position of `answer`: `ngram.match` over what precedes it, against what follows."""
    tokens = np.asarray([*prompt, *answer], dtype=np.int64)
    base, out = len(prompt), []
    for i in range(len(answer)):
        drafts, span = ngram.match(tokens[: base + i], k, lo, hi)
        truth = answer[i : i + len(drafts)]
        accepted = 0
        while accepted < len(truth) and drafts[accepted] == truth[accepted]:
            accepted += 1
        out.append(Position(span, len(drafts), accepted))
    return out


def class_table(answers: Sequence[Sequence[Position]], k: int) -> list[dict[str, Any]]:
    """Per match length class: positions with drafts, and P(drafts 1..j all accepted)."""
    rows = []
    for c, lo in enumerate(SPANS):
        ps = [p for a in answers for p in a if p.span and span_class(p.span) == c]
        rows.append(
            {
                "min_span": lo,
                "positions": len(ps),
                "accepted_up_to": [
                    sum(p.accepted >= j for p in ps) / len(ps) if ps else 0.0
                    for j in range(1, k + 1)
                ],
            }
        )
    return rows


def walk(
    answers: Sequence[Sequence[Position]], drafts: Callable[[Position], int], row_cost: float
) -> dict[str, float]:
    """Decode every answer step by step drafting `drafts(position)` (capped by what is
    proposed there): tokens per plain step's time and accepted drafts per step."""
    tokens = cost = steps = accepted = 0.0
    for answer in answers:
        i = 0
        while i < len(answer):
            p = answer[i]
            n = min(max(0, drafts(p)), p.drafted)
            a = min(n, p.accepted)
            tokens, cost, steps, accepted = (
                tokens + 1 + a,
                cost + 1 + row_cost * n,
                steps + 1,
                accepted + a,
            )
            i += 1 + a
    return {
        "tokens_per_step_time": tokens / cost if cost else 1.0,
        "accepted_per_step": accepted / steps if steps else 0.0,
    }


def best_by_class(table: Sequence[dict[str, Any]], row_cost: float) -> list[int]:
    """Per class, the draft count with the most expected tokens per step's time."""
    best = []
    for row in table:
        gain, choice, tokens = 1.0, 0, 1.0
        for j, p in enumerate(row["accepted_up_to"], 1):
            tokens += p
            if tokens / (1 + row_cost * j) > gain:
                gain, choice = tokens / (1 + row_cost * j), j
        best.append(choice)
    return best


def analyse(
    answers: Sequence[Sequence[Position]], k: int, row_costs: Sequence[float]
) -> dict[str, Any]:
    table = class_table(answers, k)
    out: dict[str, Any] = {"classes": table, "by_row_cost": []}
    for r in row_costs:
        per_class = best_by_class(table, r)
        rows = {f"fixed {n}": walk(answers, _fixed(n), r) for n in range(k + 1)}
        rows["by class"] = walk(answers, _by_class(per_class), r)
        rows["oracle"] = walk(answers, _oracle, r)
        out["by_row_cost"].append({"row_cost": r, "by_class_k": per_class, "walks": rows})
    return out


def _fixed(n: int) -> Callable[[Position], int]:
    return lambda p: n


def _by_class(per_class: list[int]) -> Callable[[Position], int]:
    return lambda p: per_class[span_class(p.span)] if p.span else 0


def _oracle(p: Position) -> int:
    return p.accepted


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=20)
    p.add_argument("--input-len", type=int, default=900)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4, dest="k")
    p.add_argument("--row-cost", default="0.06,0.1,0.15,0.2",
                   help="verify row costs (fraction of a plain step) to walk at")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the results to this file")


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.llm import LLM
    from pdserve.engine.request import SamplingParams
    from pdserve.workloads.rag import RagWorkload

    row_costs = [float(x) for x in args.row_cost.split(",")]
    if args.k < 1 or args.num_requests < 1 or any(not 0 <= r < 10 for r in row_costs):
        raise ValueError("need -k >= 1, --num-requests >= 1 and row costs in [0, 10)")
    llm = LLM(args.model, threads=args.threads)
    items = list(
        RagWorkload(args.num_requests, args.input_len, args.output_len, 0.0, 0, llm.get_tokenizer())
    )
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    outs = llm.generate([it.text or it.prompt for it in items], params)
    spec = SpeculativeConfig()
    answers = [
        positions(o.prompt_token_ids, o.outputs[0].token_ids, args.k, spec.prompt_lookup_min,
                  spec.prompt_lookup_max)
        for o in outs
    ]  # fmt: skip
    result = analyse(answers, args.k, row_costs)
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)
    return 0


def _print(result: dict[str, Any]) -> None:
    print("match length  positions  drafts 1..k accepted up to each")
    for row in result["classes"]:
        ups = " ".join(f"{p:.2f}" for p in row["accepted_up_to"])
        print(f"{row['min_span']:>11}+ {row['positions']:>10}  {ups}")
    for block in result["by_row_cost"]:
        cells = ", ".join(
            f"{name} {w['tokens_per_step_time']:.3f}" for name, w in block["walks"].items()
        )
        print(f"row cost {block['row_cost']}: tokens per step's time: {cells}")
