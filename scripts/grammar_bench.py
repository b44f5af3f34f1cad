"""Grammar libraries side by side on the default model's tokenizer (vocab 49152): setup (tokenizer
info, schema compile), per-token mask cost (compute the allowed-token bitmask, apply it to the
logits, advance the matcher) and correctness (every finished document parses and validates).

The "model" is random logits (seeded): every library sees the same logits at step k, so they walk
comparable (not identical: masks differ) paths; what is timed is the grammar work per token.

    PYTHONPATH=src python scripts/grammar_bench.py [--runs 20] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["id", "point", "ok"],
        "additionalProperties": False,
    },
}


class Lib:
    """One library behind four calls: start a matcher, fill a bool mask, accept, done?"""

    name = ""

    def start(self) -> Any: ...
    def allowed(self, m: Any) -> torch.Tensor: ...
    def accept(self, m: Any, token: int) -> bool: ...
    def done(self, m: Any) -> bool: ...


class LLGuidance(Lib):
    name = "llguidance 1.9.1"

    def __init__(self, tokenizer: Any, schema: dict[str, Any], vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        self.vocab = vocab

    def start(self) -> Any:
        m = self.ll.LLMatcher(self.tok, self.grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def allowed(self, m: Any) -> torch.Tensor:
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool))

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token))

    def done(self, m: Any) -> bool:
        return bool(m.is_stopped())


class XGrammar(Lib):
    name = "xgrammar 0.2.8"

    def __init__(self, tokenizer: Any, schema: dict[str, Any], vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiled = xgr.GrammarCompiler(info).compile_json_schema(
            json.dumps(schema), any_whitespace=False
        )
        self.vocab = vocab
        self.mask = xgr.allocate_token_bitmask(1, vocab)

    def start(self) -> Any:
        return self.xgr.GrammarMatcher(self.compiled)

    def allowed(self, m: Any) -> torch.Tensor:
        m.fill_next_token_bitmask(self.mask)
        bits = self.mask.numpy().view(np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool))

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def done(self, m: Any) -> bool:
        return bool(m.is_terminated())


class OutlinesCore(Lib):
    name = "outlines-core 0.2.14"

    def __init__(self, tokenizer: Any, schema: dict[str, Any], vocab: int) -> None:
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = oc
        eos = int(tokenizer.eos_token_id)
        tokens: dict[str, list[int]] = {}
        for tid in range(len(tokenizer)):
            if tid == eos:
                continue
            text = tokenizer.convert_ids_to_tokens(tid)
            tokens.setdefault(text, []).append(tid)
        self.vocab_obj = oc.Vocabulary(eos, tokens)
        self.index = oc.Index(build_regex_from_schema(json.dumps(schema)), self.vocab_obj)
        self.vocab = vocab

    def start(self) -> Any:
        return self.oc.Guide(self.index)

    def allowed(self, m: Any) -> torch.Tensor:
        mask = torch.zeros(self.vocab, dtype=torch.bool)
        mask[torch.tensor(m.get_tokens(), dtype=torch.long)] = True
        return mask

    def accept(self, m: Any, token: int) -> bool:
        m.advance(token)
        return True

    def done(self, m: Any) -> bool:
        return bool(m.is_finished())


def walk(lib: Lib, runs: int, max_tokens: int, tokenizer: Any, schema: dict) -> dict[str, Any]:
    import jsonschema_rs

    validator = jsonschema_rs.validator_for(schema)
    per_token: list[float] = []
    finished = valid = 0
    for run in range(runs):
        g = torch.Generator().manual_seed(run)
        m = lib.start()
        out: list[int] = []
        for _ in range(max_tokens):
            logits = torch.randn(lib.vocab, generator=g) * 4
            t0 = time.perf_counter()
            allowed = lib.allowed(m)
            logits.masked_fill_(~allowed, float("-inf"))
            token = int(logits.argmax())
            ok = lib.accept(m, token)
            per_token.append(time.perf_counter() - t0)
            assert ok, f"{lib.name} refused a token its own mask allowed"
            out.append(token)
            if lib.done(m):  # llguidance stops after the closing brace, xgrammar after EOS
                break
        if lib.done(m):
            finished += 1
            text = tokenizer.decode([t for t in out if t != tokenizer.eos_token_id])
            with contextlib.suppress(json.JSONDecodeError):
                valid += validator.is_valid(json.loads(text))
    return {
        "us_per_token_median": statistics.median(per_token) * 1e6,
        "us_per_token_p90": sorted(per_token)[int(0.9 * len(per_token))] * 1e6,
        "tokens": len(per_token),
        "finished": finished,
        "valid": valid,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--libs", default="llguidance,xgrammar,outlines")
    args = ap.parse_args()
    from pdserve.engine import loader

    tokenizer = loader.load_tokenizer(loader.resolve_model(None))
    vocab = 49152
    builders: dict[str, Callable[..., Lib]] = {
        "llguidance": LLGuidance,
        "xgrammar": XGrammar,
        "outlines": OutlinesCore,
    }
    for schema_name, schema in SCHEMAS.items():
        for key in args.libs.split(","):
            t0 = time.perf_counter()
            try:
                lib = builders[key](tokenizer, schema, vocab)
            except Exception as e:  # a library that cannot build this schema is a result too
                print(f"{schema_name:7} {key:11} setup failed: {type(e).__name__}: {e}")
                continue
            setup = time.perf_counter() - t0
            r = walk(lib, args.runs, args.max_tokens, tokenizer, schema)
            print(
                f"{schema_name:7} {lib.name:21} setup {setup:6.2f} s  "
                f"mask+apply+accept median {r['us_per_token_median']:7.0f} us  "
                f"p90 {r['us_per_token_p90']:7.0f} us  tokens {r['tokens']:5}  "
                f"finished {r['finished']}/{args.runs}  valid {r['valid']}/{r['finished']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
