"""`SpeculativeConfig`: prompt-lookup (n-gram) speculative decoding, spelled as vLLM's
`--speculative-config` JSON (`{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 1}`). No torch here: config.py validates with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 15  # a verify chunk of 1 + k rows stays within one kernel tile (16)
# The decode batch from which no step drafts (a hard bound; below it engine/spec/pacing.py caps
# each step's drafts from measured step times). `pdserve bench spec-crossover --threads 2` on
# the Xeon (AMX) host, SmolLM2-135M, 1024-token contexts, k = 4: a verify step costs 1.98x a
# plain one at batch 1, 3.67x at 16, 5.06x at 32, while the measured acceptance on RAG answers
# is about 0.9 drafts per step (docs/benchmarks/spec/): from 16 it would need 2.7 accepted.
DEFAULT_DISABLE_BY_BATCH_SIZE = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # vLLM's name: no drafts in a step whose decode batch is at least this large (counted).
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(METHODS)}, "
                f"got {self.method!r}"
            )
        ints = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
        for name in (*ints, "disable_by_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"speculative_config: {name} must be an integer, got {value!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                "speculative_config: num_speculative_tokens must be in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min < 1:
            raise ValueError(
                f"speculative_config: prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}"
            )
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                "speculative_config: prompt_lookup_max must be >= prompt_lookup_min "
                f"({self.prompt_lookup_min}), got {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size < 1:
            raise ValueError(
                "speculative_config: disable_by_batch_size must be >= 1, "
                f"got {self.disable_by_batch_size}"
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def parse_speculative_config(value: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
    """A JSON string (the flag) or a mapping (`LLM(speculative_config=...)`, YAML) -> the
    config; None stays None. Unknown keys are refused by name."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e})") from None
    if not isinstance(value, Mapping):
        raise ValueError("speculative_config: expected a JSON object of settings")
    known = set(SpeculativeConfig.__dataclass_fields__)
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"speculative_config: unknown keys {unknown}; accepted: {', '.join(sorted(known))}"
        )
    if "method" not in value:
        raise ValueError("speculative_config: method is required (ngram)")
    return SpeculativeConfig(**value)
