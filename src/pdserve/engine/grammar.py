"""Structured outputs: a grammar (JSON schema, JSON object, regex, choice, Lark) constrains which
tokens the sampler may pick, through llguidance (docs/benchmarks/api.md has the measured choice).

A request carries its constraint as a plain dict, `SamplingParams.structured_outputs` (vLLM's
names): exactly one of `json` (a schema, dict or JSON text), `json_object` (true: any JSON
object), `regex`, `choice` (a list of strings), `grammar` (Lark). The dict travels to the workers
as it is; each worker compiles it against its tokenizer. A matcher follows the request's own
output tokens, so the state crosses P -> D by replay: D builds a fresh matcher and feeds it the
hand-off tokens P sampled (one, usually: ~2 ms to build, microseconds to replay; llguidance has
no state blob, and the build is needed on D either way).

JSON is generated compact (no free whitespace between tokens): a small model otherwise tends to
loop on newlines inside an object until max_tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_JSON_OPTIONS: Any = {"whitespace_flexible": False}  # llguidance JsonCompileOptions


def check_spec(spec: Any) -> None:
    """Raise ValueError (starting with "structured_outputs") unless `spec` is one valid
    constraint; compiles it without a tokenizer, so schema and regex errors surface here."""
    grammar_text(spec)


def grammar_text(spec: Any) -> str:
    """The llguidance grammar of a constraint (validated; cached by its JSON text)."""
    if not isinstance(spec, dict):
        raise ValueError(f"structured_outputs must be an object, got {type(spec).__name__}")
    set_keys = [k for k, v in spec.items() if v is not None and v is not False]
    unknown = [k for k in spec if k not in KINDS]
    if unknown:
        raise ValueError(f"structured_outputs: unknown constraint {unknown[0]!r} (one of {KINDS})")
    if len(set_keys) != 1:
        raise ValueError(
            f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {set_keys or 'none'}"
        )
    kind = set_keys[0]
    try:
        key = json.dumps(spec[kind], sort_keys=True)
    except (TypeError, ValueError):
        raise ValueError(f"structured_outputs.{kind} is not JSON-serialisable") from None
    return _compiled(kind, key)


@lru_cache(maxsize=256)
def _compiled(kind: str, value_json: str) -> str:
    from llguidance import LLMatcher

    value = json.loads(value_json)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(value, dict | bool):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        try:
            grammar = LLMatcher.grammar_from_json_schema(json.dumps(value), defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is invalid: {e}") from None
    elif kind == "json_object":
        if value is not True:
            raise ValueError("structured_outputs.json_object must be true")
        grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    elif kind == "regex":
        if not isinstance(value, str):
            raise ValueError("structured_outputs.regex must be a string")
        grammar = LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        grammar = LLMatcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in value))
    else:
        if not isinstance(value, str):
            raise ValueError("structured_outputs.grammar must be a Lark grammar (a string)")
        grammar = LLMatcher.grammar_from_lark(value)
    error = LLMatcher.validate_grammar(grammar, None)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"structured_outputs.{kind} is invalid: {error.strip()}")
    return grammar


class Matcher:
    """One request's grammar state: the tokens allowed next, and advancing by the sampled one."""

    def __init__(self, inner: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self._m, self._vocab, self._eos = inner, vocab_size, eos_token_id
        self.error: str | None = None  # the library gave up (a resource limit): the request ends
        self.reported = False  # the engine counted and logged the error

    def allowed(self) -> torch.Tensor:
        """Bool [vocab]: True where the grammar allows the token next."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self._vocab].astype(bool)
        if self._m.is_error() or not mask.any():
            # nothing is allowed (llguidance hit a limit): end the request with EOS rather than
            # sample from all -inf; counted and logged by the engine, never silent
            self.error = self._m.get_error() or "the grammar allows no token"
            mask[:] = False
            if self._eos is not None and self._eos < self._vocab:
                mask[self._eos] = True
        return torch.from_numpy(mask)

    def accept(self, token: int) -> None:
        """Advance by a token sampled under this matcher's mask. Refused all the same (the
        library hit a limit mid-token): the matcher gives up, the request ends at its next
        step (counted by the engine) rather than failing the whole engine step."""
        if self.error is None and not self._m.consume_token(token):
            self.error = self._m.get_error() or f"token {token} refused"

    def replay(self, tokens: Sequence[int]) -> None:
        """Catch up with tokens sampled elsewhere (P's hand-off tokens, a fork's first one); a
        token that does not fit means P and D disagree: ValueError (the hand-off fails)."""
        for token in tokens:
            if self.done:
                break  # EOS after a complete document: nothing left to follow
            if not self._m.consume_token(token):
                raise ValueError(f"token {token} does not fit the grammar: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the request stops here)."""
        return self.error is not None or bool(self._m.is_stopped())


class GrammarBackend:
    """Compiles constraints against one tokenizer; built lazily (the tokenizer's token trie
    takes ~0.5 s the first time a constrained request arrives)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf, self._vocab = tokenizer, vocab_size
        self._tok: Any = None

    def matcher(self, spec: dict[str, Any]) -> Matcher:
        from llguidance import LLMatcher

        grammar = grammar_text(spec)
        if self._tok is None:
            import llguidance.hf

            self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab)
        inner = LLMatcher(self._tok, grammar, log_level=0)
        if inner.is_error():
            raise ValueError(f"structured_outputs: {inner.get_error()}")
        return Matcher(inner, self._vocab, self._hf.eos_token_id)
