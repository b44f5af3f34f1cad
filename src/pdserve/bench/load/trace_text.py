"""Trace prompts as text whose blocks are exact token blocks under the served model's tokenizer.

A trace says only how long each 512-token block is and which blocks repeat (`traces.py`). The
text of a block is `n` words drawn (seeded, fixed per block key: `traces.block_draw`) from a
pool of words that are each one token *with their leading space* (" the", " water"): a block
is " w1 w2 ... wn", exactly `n` tokens, and two blocks side by side are exactly the sum of
their tokens, because a tokenizer that splits words at spaces never merges across them. The
pool is checked against the tokenizer when it is built, and a block and two blocks side by
side are checked again (`check`): a tokenizer where this does not hold is refused with an
error, never replayed with prompts of the wrong length. `bench replay` also asks the server
to count one and two blocks (usage.prompt_tokens), so a `--tokenizer` other than the served
model's is caught too.
"""

from __future__ import annotations

from typing import Any, Protocol

from pdserve.workloads.traces import TraceRequest, block_draw, block_keys

POOL_MAX = 4096  # words kept: plenty for blocks that never repeat by chance
CHECK_KEYS = ((2, 0), (2, 1))  # key space 2: only for checks, never a trace's block


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = ...) -> Any: ...
    def __len__(self) -> int: ...


def _candidates(tok: Tokenizer) -> list[str]:
    """Vocabulary entries that read as a space (GPT-2 'Ġ', SentencePiece '▁') then 2-8 ASCII
    letters, in id order (deterministic for a given tokenizer)."""
    words: list[str] = []
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    for piece in pieces:
        if isinstance(piece, str) and piece[:1] in ("Ġ", "▁"):
            word = piece[1:]
            if 2 <= len(word) <= 8 and word.isascii() and word.isalpha():
                words.append(word)
    return words


class BlockText:
    """Text of trace blocks: one token per word, `seed` fixes each block key's words."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0) -> None:
        self.tok, self.seed = tokenizer, seed
        pool = []
        for word in _candidates(tokenizer):
            if len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1:
                pool.append(word)
                if len(pool) == POOL_MAX:
                    break
        if len(pool) < 64:
            raise ValueError(
                f"the tokenizer has {len(pool)} words that are one token with a leading space; "
                "trace prompts need such words (use --prompt-format ids)"
            )
        self.words = pool

    def block(self, key: tuple[int, int], n: int) -> str:
        """`n` tokens of text for the block `key` (a prefix of any longer block of that key)."""
        draw = block_draw(key, n, len(self.words), self.seed)
        return "".join(" " + self.words[int(i)] for i in draw)

    def prompt(self, req: TraceRequest, index: int) -> str:
        keys = block_keys(req, index)
        return "".join(self.block(k, n) for k, n in zip(keys, req.blocks, strict=True))

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def check(self, n: int) -> tuple[str, str]:
        """Two test blocks of `n` tokens, after checking that this tokenizer counts one as `n`
        and both side by side as 2n; returned for the server's own count."""
        a, b = (self.block(k, n) for k in CHECK_KEYS)
        if self.count(a) != n or self.count(a + b) != 2 * n:
            raise ValueError(
                f"a {n}-token block of words tokenizes to {self.count(a)} tokens and two to "
                f"{self.count(a + b)}: this tokenizer merges across words; use --prompt-format ids"
            )
        return a, a + b


def server_block_tokens(usage_one: dict[str, Any], usage_two: dict[str, Any]) -> int | None:
    """Tokens the server counted for the second block: prompt_tokens of two blocks minus one
    (a BOS the server adds cancels out); None when it reports no usage."""
    one, two = usage_one.get("prompt_tokens"), usage_two.get("prompt_tokens")
    if not isinstance(one, int) or not isinstance(two, int):
        return None
    return two - one
