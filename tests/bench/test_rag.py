"""The `rag` workload: its knowledge base (and that the builder reproduces it), BM25 retrieval
quality on data/kb/questions.jsonl, prompt assembly to a token target, determinism, and its
registration in `WORKLOADS`."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from pdserve.workloads import rag
from pdserve.workloads.rag import (
    SYSTEM_PROMPT,
    KnowledgeBase,
    Passage,
    Question,
    RagWorkload,
    load_questions,
)
from pdserve.workloads.streams import WORKLOADS, Workload, make_workload, sample_lengths

REPO = Path(__file__).resolve().parents[2]
KB_DIR = REPO / "data" / "kb"


@pytest.fixture(scope="module")
def kb() -> KnowledgeBase:
    return KnowledgeBase.load()


@pytest.fixture(scope="module")
def questions() -> list[Question]:
    return load_questions()


@pytest.fixture(scope="module")
def assembler(default_tokenizer: Any, kb: KnowledgeBase) -> RagWorkload:
    """A workload of no requests, for its prompt assembly (`build_prompt`)."""
    return RagWorkload(0, 1000, 16, 0.0, 0, default_tokenizer, kb=kb)


def _n_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------- the data


def test_kb_file_is_the_default_and_well_formed(kb: KnowledgeBase) -> None:
    assert rag.KB_FILE == KB_DIR / "python_reference.jsonl"
    assert rag.KB_FILE.stat().st_size < 1_000_000
    ids = [p.id for p in kb.passages]
    assert len(ids) == len(set(ids)) > 200
    from pydoc_data.topics import topics

    assert {p.topic for p in kb.passages} == set(topics)  # every topic keeps a passage
    for p in kb.passages:
        assert p.id.startswith(p.topic + "#") and p.title and p.text.strip()
    words = [len(p.text.split()) for p in kb.passages]
    assert max(words) <= 300 and 100 <= float(np.median(words)) <= 250


def test_questions_cover_many_topics(kb: KnowledgeBase, questions: list[Question]) -> None:
    assert len(questions) >= 60
    assert len({q.question for q in questions}) == len(questions)
    assert len({q.topic for q in questions}) >= 30
    kb_topics = {p.topic for p in kb.passages}
    assert all(q.topic in kb_topics and q.question.endswith("?") for q in questions)


def _load_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_kb", REPO / "scripts" / "build_kb.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_builder_reproduces_committed_kb() -> None:
    from pydoc_data.topics import topics

    build_kb = _load_builder()
    manifest = json.loads((KB_DIR / "manifest.json").read_text())
    if build_kb.source_sha256(topics) != manifest["source_sha256"]:
        # pydoc_data.topics changes between CPython releases, so the passages would too
        pytest.skip(f"pydoc_data differs from the KB's source (CPython {manifest['python']})")
    jsonl, fresh = build_kb.build()
    assert jsonl == rag.KB_FILE.read_text(encoding="utf-8")
    assert fresh == manifest


# ---------------------------------------------------------------------------- retrieval


def test_retrieval_finds_the_topic_in_top3(kb: KnowledgeBase, questions: list[Question]) -> None:
    hits = [q.topic in {p.topic for p in kb.retrieve(q.question, 3)} for q in questions]
    misses = [q.question for q, hit in zip(questions, hits, strict=True) if not hit]
    assert sum(hits) / len(hits) >= 0.9, misses


@pytest.mark.parametrize(
    ("question", "topic"),
    [
        ("How does the with statement call __enter__ and __exit__?", "with"),
        ("What does the nonlocal statement do and which scope does it search?", "nonlocal"),
        ("Why are leading zeros not allowed in a non-zero decimal integer literal?", "integers"),
        ("What does the __missing__ method do in a subclass of dict?", "typesmapping"),
        ("How do I set a conditional breakpoint with the pdb debugger?", "debugger"),
        ("When is the else clause of a while loop executed?", "while"),
    ],
)
def test_retrieval_top1(kb: KnowledgeBase, question: str, topic: str) -> None:
    assert kb.retrieve(question, 1)[0].topic == topic


def test_retrieve_ranks_consistently(kb: KnowledgeBase) -> None:
    q = "How are keyword arguments matched to parameters in a call?"
    assert kb.retrieve(q, 5) == kb.retrieve(q, 12)[:5]
    assert kb.retrieve(q, 0) == []
    everything = kb.retrieve(q, 10 * len(kb))
    assert len(everything) == len(kb) and len({p.id for p in everything}) == len(kb)
    # no word the corpus knows (stopwords, unknown words): still k passages, no error
    assert len(kb.retrieve("the of and zzzqqq", 3)) == 3
    assert not kb.scores("zzzqqq").any()


def test_kb_from_custom_passages(tmp_path: Path) -> None:
    records = [
        {"id": "a#0", "topic": "a", "title": "Apples", "text": "Apples are red fruit."},
        {"id": "b#0", "topic": "b", "title": "Bananas", "text": "Bananas are long and yellow."},
    ]
    path = tmp_path / "kb.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    kb = KnowledgeBase.load(path)
    assert kb.retrieve("which one is yellow?", 1) == [Passage(**records[1])]
    assert kb.retrieve("red ones?", 2) == [Passage(**records[0]), Passage(**records[1])]
    with pytest.raises(ValueError, match="at least one passage"):
        KnowledgeBase([])


def test_missing_or_bad_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"knowledge base file not found: .*nope\.jsonl"):
        KnowledgeBase.load(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="question file not found"):
        load_questions(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x#0", "topic": "x", "title": "X"}\n')
    with pytest.raises(ValueError, match="missing field 'text'"):
        KnowledgeBase.load(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: not JSON"):
        load_questions(bad)


# ---------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("target", [300, 1000, 2000])
def test_prompt_hits_target_length(
    assembler: RagWorkload, kb: KnowledgeBase, default_tokenizer: Any, target: int
) -> None:
    for question in (
        "When does the else clause of a try statement run?",
        "What does the r prefix do in a raw string literal and how are backslashes treated?",
        "How is the appropriate metaclass for a class definition determined?",
    ):
        text = assembler.build_prompt(question, target)
        n = _n_tokens(default_tokenizer, text)
        assert target * 0.98 <= n <= target * 1.02, (target, n)
        assert target - 3 <= n <= target  # in practice: exact, or a token or two short
        top = kb.retrieve(question, 2)
        assert f"Question: {question}" in text and SYSTEM_PROMPT in text
        assert f"[1] {top[0].title}\n{top[0].text[:100]}" in text  # the best passage first
        if "[2] " in text:
            assert text.index("[1] ") < text.index(f"[2] {top[1].title}")
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_long_prompt_retrieves_past_the_first_k(
    assembler: RagWorkload, default_tokenizer: Any
) -> None:
    text = assembler.build_prompt("How are class decorators evaluated?", 8000)
    assert 7840 <= _n_tokens(default_tokenizer, text) <= 8000
    assert f"[{rag._FIRST_K + 1}] " in text and f"[{2 * rag._FIRST_K + 1}] " in text


def test_target_below_instruction_and_question(assembler: RagWorkload) -> None:
    text = assembler.build_prompt("What does the pass statement do?", 10)
    assert "[1] " not in text and "Question: What does the pass statement do?" in text


# ---------------------------------------------------------------------------- the workload


def test_workload_items(
    default_tokenizer: Any, kb: KnowledgeBase, questions: list[Question]
) -> None:
    w = RagWorkload(6, 400, 32, 0.5, 3, default_tokenizer, kb=kb, questions=questions)
    assert isinstance(w, Workload) and w.name == "rag"
    items = list(w)
    rng = np.random.default_rng(3)
    targets = sample_lengths(rng, 400, 0.5, 6)
    outs = sample_lengths(rng, 32, 0.5, 6)
    assert [it.max_tokens for it in items] == outs
    asked = {q.question for q in questions}
    for i, (it, target, q) in enumerate(zip(items, targets, w.questions, strict=True)):
        assert (it.conversation, it.turn) == (i, 0) and q in asked
        assert it.text is not None and f"Question: {q}" in it.text
        assert it.prompt == default_tokenizer(it.text, add_special_tokens=False)["input_ids"]
        assert target - 3 <= len(it.prompt) <= target
    assert len(set(w.questions)) == 6  # a permutation: no repeats before every one was asked


def test_workload_is_seeded(default_tokenizer: Any, kb: KnowledgeBase) -> None:
    def run(seed: int) -> list[tuple[str | None, int]]:
        w = RagWorkload(5, 300, 16, 0.3, seed, default_tokenizer, kb=kb)
        return [(it.text, it.max_tokens) for it in w]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_questions_cycle(default_tokenizer: Any, kb: KnowledgeBase) -> None:
    pool = ["What does the pass statement do?", "When is a while loop's else run?"]
    w = RagWorkload(5, 200, 8, 0.0, 0, default_tokenizer, kb=kb, questions=pool)
    assert sorted(w.questions[:2]) == sorted(pool)
    assert w.questions[2:4] == w.questions[:2] and w.questions[4] == w.questions[0]
    with pytest.raises(ValueError, match="at least one question"):
        RagWorkload(1, 200, 8, 0.0, 0, default_tokenizer, kb=kb, questions=[])


def test_registered_with_lazy_tokenizer(
    monkeypatch: pytest.MonkeyPatch, default_tokenizer: Any
) -> None:
    from pdserve.engine import loader

    asked: list[object] = []

    def fake_load(src: object) -> Any:
        asked.append(src)
        return default_tokenizer

    monkeypatch.setattr(loader, "load_tokenizer", fake_load)
    args = argparse.Namespace(
        workload="rag", num_requests=2, input_len=250, output_len=8, len_spread=0.0, seed=0
    )
    assert "rag" in WORKLOADS
    w = make_workload(args)  # no `tokenizer` attribute at all: the default model's
    assert w.name == "rag" and len(list(w)) == 2
    args.tokenizer = None
    make_workload(args)
    assert asked == [loader.resolve_model(None)] * 2


def test_importing_stays_cheap() -> None:
    code = (
        "import sys, pdserve.workloads.streams, pdserve.workloads.rag\n"
        "print(sorted(m for m in ('bm25s', 'transformers', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
