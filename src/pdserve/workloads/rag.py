"""The `rag` workload: knowledge-base question answering over the Python language reference.

Each request is a question from data/kb/questions.jsonl, answered from the knowledge base
(data/kb/python_reference.jsonl, built by scripts/build_kb.py from CPython's
`pydoc_data.topics`): the passages BM25 ranks highest for the question are put into the prompt,
best first, until the prompt reaches its target length (the last one cut at a token boundary),
then the question. The prompt is rendered with the tokenizer's chat template (a system message
with the instruction, a user message with context and question) and sent as text; its token ids
under that tokenizer give its length.

Unlike the synthetic workloads the prompts are real text with a realistic structure: requests
about related questions share their leading passages, and every request shares the system
prompt, so a prefix cache sees partial, not total, reuse.

bm25s (and the tokenizer) are only needed when a knowledge base or workload is built, so
importing this module stays cheap.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.workloads.items import RequestItem, sample_lengths

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

KB_DIR = Path(__file__).resolve().parents[3] / "data" / "kb"
KB_FILE = KB_DIR / "python_reference.jsonl"
QUESTIONS_FILE = KB_DIR / "questions.jsonl"

SYSTEM_PROMPT = (
    "Answer the question using only the context below, which is taken from the Python "
    "language reference. Cite the passages you use by their number, e.g. [2]. If the context "
    "does not contain the answer, say that you don't know."
)

_FIRST_K = 8  # passages retrieved at first; doubled while a prompt needs more
_FIT_STEPS = 8  # corrections of the last passage's cut before settling for the best one
_FIT_SLACK = 2  # a prompt this many tokens under its target is close enough


@dataclass(frozen=True)
class Passage:
    id: str  # "<topic>#<n>"
    topic: str  # the pydoc_data.topics key
    title: str
    text: str


@dataclass(frozen=True)
class Question:
    question: str
    topic: str  # the topic whose passages answer it


def _read_jsonl(path: Path, what: str) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ValueError(
            f"{what} not found: {path} (the repository's data/kb/ files; "
            "regenerate the knowledge base with scripts/build_kb.py)"
        )
    records = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from None
    if not records:
        raise ValueError(f"{what} {path} is empty")
    return records


def _fields(record: dict[str, Any], names: Sequence[str], where: str) -> list[str]:
    try:
        return [str(record[name]) for name in names]
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e}") from None


def load_questions(path: str | Path | None = None) -> list[Question]:
    """The questions, default: data/kb/questions.jsonl ({"question": ..., "topic": ...} lines)."""
    p = Path(path) if path is not None else QUESTIONS_FILE
    records = _read_jsonl(p, "question file")
    return [Question(*_fields(r, ("question", "topic"), f"{p}")) for r in records]


class KnowledgeBase:
    """Passages with a BM25 index over title + text, built once."""

    def __init__(self, passages: Sequence[Passage]) -> None:
        if not passages:
            raise ValueError("a knowledge base needs at least one passage")
        import bm25s  # here, not at module level: it is only needed once a KB is built

        self.passages: tuple[Passage, ...] = tuple(passages)
        # bm25s' own tokenizer: lowercased words, English stopwords dropped; the query is
        # tokenised with the same vocabulary (words the corpus lacks cannot score, so are dropped)
        self._words = bm25s.tokenization.Tokenizer(stopwords="en")
        corpus = [f"{p.title}\n{p.text}" for p in self.passages]
        ids = self._words.tokenize(corpus, return_as="ids", show_progress=False)
        self._bm25 = bm25s.BM25()
        self._bm25.index((ids, self._words.get_vocab_dict()), show_progress=False)

    @classmethod
    def load(cls, path: str | Path | None = None) -> KnowledgeBase:
        """From a jsonl of {"id", "topic", "title", "text"}; default: data/kb's reference KB."""
        p = Path(path) if path is not None else KB_FILE
        records = _read_jsonl(p, "knowledge base file")
        names = ("id", "topic", "title", "text")
        return cls([Passage(*_fields(r, names, f"{p}")) for r in records])

    def __len__(self) -> int:
        return len(self.passages)

    def scores(self, question: str) -> np.ndarray:
        """BM25 score of every passage for `question` (all 0 if it shares no word with them)."""
        query = self._words.tokenize(
            [question], update_vocab=False, return_as="ids", show_progress=False
        )[0]
        if not query:
            return np.zeros(len(self.passages), dtype=np.float32)
        return np.asarray(self._bm25.get_scores_from_ids(query))

    def retrieve(self, question: str, k: int) -> list[Passage]:
        """The `k` best passages for `question`, best first; ties in passage order, so the top
        k is always a prefix of the top k + 1."""
        if k < 1:
            return []
        order = np.argsort(-self.scores(question), kind="stable")[:k]
        return [self.passages[i] for i in order]


class RagWorkload:
    """`num_requests` knowledge-base questions, each with retrieved context filling its prompt
    to a target length around `input_len` tokens.

    Request i asks question order[i % len(questions)] for a seeded permutation `order`, so a
    run cycles through every question before repeating one. Targets and `max_tokens` follow
    `input_len`/`output_len` and `spread` as in the synthetic workload. A prompt's token count
    is the target or at most a few tokens under it; it is over only when the instruction and
    question alone are longer than the target (then there is no context) and under when the
    whole knowledge base is shorter.
    """

    name = "rag"

    def __init__(
        self,
        num_requests: int,
        input_len: int,
        output_len: int,
        spread: float,
        seed: int,
        tokenizer: PreTrainedTokenizerBase,
        kb: KnowledgeBase | None = None,
        questions: Sequence[Question | str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.kb = kb if kb is not None else KnowledgeBase.load()
        if questions is None:
            questions = load_questions()
        pool = [q.question if isinstance(q, Question) else q for q in questions]
        if not pool:
            raise ValueError("the rag workload needs at least one question")
        self._ids_cache: dict[str, list[int]] = {}
        rng = np.random.default_rng(seed)
        targets = sample_lengths(rng, input_len, spread, num_requests)
        outs = sample_lengths(rng, output_len, spread, num_requests)
        order = rng.permutation(len(pool))
        self.questions = [pool[order[i % len(pool)]] for i in range(num_requests)]
        self._items: list[RequestItem] = []
        for i, (question, target, out) in enumerate(
            zip(self.questions, targets, outs, strict=True)
        ):
            text = self.build_prompt(question, target)
            self._items.append(RequestItem(self._ids(text), out, conversation=i, text=text))

    def __iter__(self) -> Iterator[RequestItem]:
        return iter(self._items)

    # ------------------------------------------------------------------ prompt assembly

    def build_prompt(self, question: str, target: int) -> str:
        """The rendered prompt for `question`: ranked passages until `target` tokens."""
        blocks: list[str] = []
        used = len(self._ids(self.render(question, blocks)))
        if used >= target:
            return self.render(question, blocks)
        for rank, passage in enumerate(self._ranked(question), 1):
            block = f"[{rank}] {passage.title}\n{passage.text}"
            # "\n\n" + block, as joined into the message: a close estimate of what it adds
            cost = len(self._block_ids("\n\n" + block))
            if used + cost > target:
                return self._fit(question, blocks, block, target)
            blocks.append(block)
            used += cost
        return self.render(question, blocks)  # the whole KB is shorter than the target

    def render(self, question: str, blocks: Sequence[str]) -> str:
        """The chat-template prompt: instruction as system message, context + question as user."""
        user = "\n\n".join(["Context:", *blocks, f"Question: {question}"])
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": user},
        ]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert isinstance(text, str)
        return text

    def _fit(self, question: str, blocks: list[str], last: str, target: int) -> str:
        """`blocks` + the longest token prefix of `last` that keeps the prompt within `target`.

        Token counts are not additive across the joins, so the cut is corrected from the real
        count of the rendered prompt a few times; the best prompt not over the target wins.
        """
        base = self.render(question, blocks)
        best, best_len = base, len(self._ids(base))
        if best_len > target and blocks:  # the estimates for whole passages ran a little over
            return self._fit(question, blocks[:-1], blocks[-1], target)
        ids = self._block_ids(last)
        keep = min(len(ids), target - best_len - 1)  # "-1": the "\n\n" before the block
        for _ in range(_FIT_STEPS):
            if keep <= 0:
                break
            text = self.render(question, [*blocks, self._cut(ids, keep)])
            n = len(self._ids(text))
            if best_len < n <= target:
                best, best_len = text, n
            if target - _FIT_SLACK <= n <= target:
                break
            step = max(-keep, min(target - n, len(ids) - keep))
            if step == 0:
                break
            keep += step
        return best

    def _cut(self, ids: list[int], keep: int) -> str:
        # a cut inside a multi-byte character decodes to U+FFFD: drop that partial character
        return str(self.tokenizer.decode(ids[:keep])).rstrip("\ufffd")

    def _ids(self, text: str) -> list[int]:
        """Token ids of `text`; the rendered template already holds every special token."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _block_ids(self, text: str) -> list[int]:
        """`_ids`, cached: the same passages come back for the same and related questions."""
        ids = self._ids_cache.get(text)
        if ids is None:
            ids = self._ids_cache[text] = self._ids(text)
        return ids

    def _ranked(self, question: str) -> Iterator[Passage]:
        """Passages best first, retrieving more (k doubled) whenever the ones so far run out."""
        k, given = _FIRST_K, 0
        while given < len(self.kb):
            top = self.kb.retrieve(question, k)
            yield from top[given:]
            given, k = len(top), k * 2
