"""Build the `rag` workload's knowledge base, data/kb/python_reference.jsonl, from the Python
language reference topics that CPython ships as `pydoc_data.topics.topics` (PSF license).

Deterministic: the same `pydoc_data` (i.e. the same CPython release) gives the same bytes, so the
committed file can be checked and regenerated:

    .venv/bin/python scripts/build_kb.py          # rewrite data/kb/python_reference.jsonl
    .venv/bin/python scripts/build_kb.py --check  # exit 1 if the committed file differs

Each topic is split into passages of roughly MIN_WORDS..MAX_WORDS words at paragraph boundaries
(a paragraph longer than MAX_WORDS is split at sentence or line boundaries). Prose paragraphs are
unwrapped onto one line; code, grammar and tables keep their lines.
data/kb/manifest.json records the CPython version and a hash of the source topics, so a test can
tell a changed source (another CPython) from a changed builder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
import sys
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

KB_DIR = Path(__file__).resolve().parents[1] / "data" / "kb"
KB_FILE = KB_DIR / "python_reference.jsonl"
MANIFEST_FILE = KB_DIR / "manifest.json"

MIN_WORDS, MAX_WORDS = 100, 250
_DUPLICATE = 0.9  # a section this much (by words) already in a smaller topic is dropped
_CARRY = 80  # longest lead-in (words) moved to the next passage rather than ending this one

_UNDERLINE = re.compile(r"[*=\-~^]{3,}")
_FOOTNOTES = "-[ Footnotes ]-"
_PROSE_WIDTH = 45  # wrapped prose lines in pydoc_data run to ~70 columns; code rarely does
_LIST_MARKER = re.compile(r"(\*|-|\d+\.|\(\d+\)) ")
_SENTENCE_END = re.compile(r"(?<=[.!?:])\s+(?=[A-Z\"“(*])")


@dataclass(frozen=True)
class Para:
    text: str
    heading: bool = False
    keep_with_next: bool = False  # a heading, or a lead-in ("str.index(...)", "Note:")

    @property
    def words(self) -> int:
        return len(self.text.split())


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _is_heading(lines: list[str], i: int) -> bool:
    """A non-indented line underlined by a row of one rst adornment character."""
    if i + 1 >= len(lines):
        return False
    line, under = lines[i], lines[i + 1]
    return (
        bool(line.strip())
        and not line[0].isspace()
        and _UNDERLINE.fullmatch(under) is not None
        and len(set(under)) == 1
        and len(under) >= len(line.rstrip()) - 2
    )


def _indented_prose(lines: list[str]) -> bool:
    """An indented block that is wrapped prose (a method's description, a note's body, a list
    item), not code or grammar: one indentation (past a list item's marker), full-width lines,
    ends like a sentence."""
    if len(lines) < 2:
        return False
    marker = _LIST_MARKER.match(lines[0].lstrip())
    hang = len(marker.group()) if marker else 0
    if {_indent(line) for line in lines[1:]} != {_indent(lines[0]) + hang}:
        return False
    body = [line.strip() for line in lines]
    if any("::=" in line or line.startswith((">>>", "...", "+", "|")) for line in body):
        return False
    return all(len(line) >= _PROSE_WIDTH for line in body[:-1]) and body[-1][-1] in ".:)"


def _unwrap(lines: list[str]) -> str:
    """Join wrapped lines into logical lines: a line continues the previous one when that one
    ran to full width; short lines (terms, signatures, URLs) end a logical line. A logical
    line keeps its indentation, so "term\n   definition" stays a definition list."""
    out: list[str] = []
    prev_full = False
    for line in textwrap.dedent("\n".join(lines)).split("\n"):
        words = " ".join(line.split())
        if out and prev_full:
            out[-1] += " " + words
        else:
            out.append(" " * _indent(line) + words)
        prev_full = len(words) >= _PROSE_WIDTH
    return "\n".join(out)


def _render_block(lines: list[str]) -> Para:
    """One blank-line-separated block: prose is unwrapped; code, grammar and tables keep their
    lines (dedented)."""
    first = lines[0]
    if first.strip() == _FOOTNOTES:
        return Para("Footnotes", heading=True, keep_with_next=True)
    if _indented_prose(lines):
        return Para(" ".join(" ".join(lines).split()))
    if first[0].isspace() or first.startswith(("+", "|")):
        return Para(textwrap.dedent("\n".join(line.rstrip() for line in lines)))
    return Para(_unwrap(lines))


def parse_topic(raw: str) -> tuple[str, list[Para]]:
    """(title, paragraphs) of one topic; headings become heading paragraphs without underline."""
    lines = raw.split("\n")
    title = ""
    paras: list[Para] = []
    indents: list[int] = []  # each paragraph's indentation in the source
    block: list[str] = []

    def end_block() -> None:
        if block:
            paras.append(_render_block(block))
            indents.append(_indent(block[0]))
            block.clear()

    i = 0
    while i < len(lines):
        if _is_heading(lines, i):
            end_block()
            heading = " ".join(lines[i].split())
            title = title or heading
            paras.append(Para(heading, heading=True, keep_with_next=True))
            indents.append(0)
            i += 2
            continue
        if lines[i].strip():
            block.append(lines[i])
        else:
            end_block()
        i += 1
    end_block()
    # a paragraph followed by a more indented one introduces it: a signature, "Note:", "is
    # semantically equivalent to:"; a passage should not end between the two
    for j in range(len(paras) - 1):
        if indents[j + 1] > indents[j] and not paras[j + 1].heading:
            paras[j] = replace(paras[j], keep_with_next=True)
    return title, paras


def _split_long(para: Para) -> list[Para]:
    """A paragraph over MAX_WORDS as pieces of at most MAX_WORDS (a single huge unit stays whole):
    prose at sentence ends, anything with lines at line ends."""
    if para.heading or para.words <= MAX_WORDS:
        return [para]
    prose = "\n" not in para.text
    units = _SENTENCE_END.split(para.text) if prose else para.text.split("\n")
    sep = " " if prose else "\n"
    pieces: list[list[str]] = [[]]
    count = 0
    for unit in units:
        n = len(unit.split())
        if pieces[-1] and count + n > MAX_WORDS:
            pieces.append([])
            count = 0
        pieces[-1].append(unit)
        count += n
    out = [Para(sep.join(p)) for p in pieces]
    out[-1] = replace(out[-1], keep_with_next=para.keep_with_next)
    return out


def _words(paras: list[Para]) -> int:
    return sum(p.words for p in paras)


def _pack(paras: list[Para]) -> list[list[Para]]:
    """Greedy packing into passages: a passage ends before it would pass MAX_WORDS, or at a
    heading once it has MIN_WORDS; a heading or lead-in never ends a passage (it moves on)."""
    passages: list[list[Para]] = []
    cur: list[Para] = []
    for para in paras:
        n = _words(cur)
        if cur and (n + para.words > MAX_WORDS or (para.heading and n >= MIN_WORDS)):
            carry: list[Para] = []
            # keep (short) lead-ins with what they introduce
            while cur and cur[-1].keep_with_next and _words(carry) + cur[-1].words <= _CARRY:
                carry.insert(0, cur.pop())
            if cur:
                passages.append(cur)
            cur = carry
        cur.append(para)
    if cur:
        passages.append(cur)
    # a short tail reads better merged into its predecessor than as a passage of its own
    if len(passages) > 1:
        tail, prev = passages[-1], passages[-2]
        tail_n, prev_n = _words(tail), _words(prev)
        if tail_n < MIN_WORDS // 2 and tail_n + prev_n <= MAX_WORDS + MIN_WORDS // 2:
            passages[-2:] = [prev + tail]
    return passages


def _sections(paras: list[Para]) -> list[list[Para]]:
    """Paragraphs grouped from one heading to the next."""
    sections: list[list[Para]] = []
    for para in paras:
        if para.heading or not sections:
            sections.append([])
        sections[-1].append(para)
    return sections


def _own_sections(paras: list[Para], seen: set[str]) -> list[Para]:
    """The paragraphs of `paras` minus the sections whose text is (nearly) all in `seen`.

    Umbrella topics repeat smaller ones verbatim ("compound" holds "with", "if", "try"...;
    "specialnames" holds "customization", "attribute-access"...): keeping one copy keeps
    duplicate passages out of the retrieval results. A heading-only section goes with the
    section after it. A topic that would lose everything (e.g. "if" and "else" are identical)
    keeps all of it.
    """
    sections = _sections(paras)
    keep = [True] * len(sections)
    for i in reversed(range(len(sections))):
        body = [p for p in sections[i] if not p.heading]
        if not body:
            keep[i] = i + 1 < len(sections) and keep[i + 1]
            continue
        dup = sum(p.words for p in body if p.text in seen)
        keep[i] = dup < _DUPLICATE * _words(body)
    if not any(keep):
        return paras
    return [p for section, k in zip(sections, keep, strict=True) if k for p in section]


def build_passages(topics: dict[str, str]) -> list[dict[str, str]]:
    """All passages, topics in key order, as the jsonl's records."""
    parsed = {key: parse_topic(raw) for key, raw in topics.items()}
    # smaller topics first, so the specific topic keeps text that an umbrella topic repeats
    seen: set[str] = set()
    own: dict[str, list[Para]] = {}
    for key in sorted(topics, key=lambda k: (len(topics[k]), k)):
        paras = parsed[key][1]
        own[key] = _own_sections(paras, seen)
        seen.update(p.text for p in paras if not p.heading)
    records: list[dict[str, str]] = []
    for key in sorted(topics):
        title = parsed[key][0] or key
        pieces = [piece for para in own[key] for piece in _split_long(para)]
        for n, passage in enumerate(_pack(pieces)):
            text = "\n\n".join(p.text for p in passage)
            records.append({"id": f"{key}#{n}", "topic": key, "title": title, "text": text})
    return records


def render_jsonl(records: list[dict[str, str]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def source_sha256(topics: dict[str, str]) -> str:
    blob = json.dumps(topics, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


def build() -> tuple[str, dict[str, object]]:
    """(jsonl text, manifest) from this interpreter's `pydoc_data.topics`."""
    from pydoc_data.topics import topics

    records = build_passages(topics)
    jsonl = render_jsonl(records)
    manifest: dict[str, object] = {
        "source": "pydoc_data.topics.topics (CPython)",
        "python": platform.python_version(),
        "source_sha256": source_sha256(topics),
        "topics": len(topics),
        "passages": len(records),
        "jsonl_sha256": hashlib.sha256(jsonl.encode()).hexdigest(),
    }
    return jsonl, manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, don't write")
    args = parser.parse_args(argv)
    jsonl, manifest = build()
    manifest_text = json.dumps(manifest, indent=2) + "\n"
    if args.check:
        same = KB_FILE.is_file() and KB_FILE.read_text(encoding="utf-8") == jsonl
        print("up to date" if same else f"{KB_FILE} differs from a fresh build")
        return 0 if same else 1
    KB_DIR.mkdir(parents=True, exist_ok=True)
    KB_FILE.write_text(jsonl, encoding="utf-8")
    MANIFEST_FILE.write_text(manifest_text, encoding="utf-8")
    print(f"wrote {manifest['passages']} passages, {len(jsonl.encode())} bytes, to {KB_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
