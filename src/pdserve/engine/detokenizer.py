"""Incremental detokenization and stop strings.

Decoding the whole output every step is quadratic; instead a short window of tokens is decoded
and only text past the previous window is emitted. Text ending in U+FFFD (half of a multi-byte
character) is held back until the next token completes it.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""
        # Decode from a few prompt tokens back so the first word gets its leading space right.
        self._context = prompt_ids[-4:]
        self._prefix = 0  # index into context+ids where the decoding window starts
        self._read = len(self._context)  # text up to here has been emitted
        self.stop_hit: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the newly visible text (cut before a stop string if one hit)."""
        self.ids.extend(token_ids)
        seq = self._context + self.ids
        prefix_text = self._decode(seq[self._prefix : self._read])
        full = self._decode(seq[self._prefix :])
        if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix_text) :]
        self._prefix, self._read = self._read, len(seq)
        return self._append(new)

    def _append(self, new: str) -> str:
        start = len(self.text)
        self.text += new
        if not self.stop:
            return new
        # A stop string may straddle the previous text; search only where it could begin.
        lo = max(0, start - max(len(s) for s in self.stop) + 1)
        cut = min(
            ((i, s) for s in self.stop if (i := self.text.find(s, lo)) != -1),
            default=None,
        )
        if cut is None:
            return new
        self.stop_hit = cut[1]
        self.text = self.text[: cut[0]]
        return self.text[start:]
