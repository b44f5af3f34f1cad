"""A request as the engine sees it: token ids, sampling parameters, progress, status.

Progress is a single counter, `num_computed_tokens`, catching up with `num_tokens` (prompt plus
generated). There is no separate "prefill" or "decode" phase: a prompt is just many uncomputed
tokens, a decode step is one. A decode worker that receives a prompt's KV admits the request with
`num_computed_tokens = len(prompt)` and needs no special path.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (same names and defaults as vLLM's)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # OpenAI's penalties (on the generated tokens) and vLLM's repetition penalty (prompt and
    # generated), applied by the sampler on whichever worker samples: same result on P and D.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # Choices from one prompt: one prefill, then n sequences forked from its KV, choice i
    # sampled with seed + i (when seeded).
    n: int = 1
    # A grammar the output must follow (engine/grammar.py): exactly one of json (a schema),
    # json_object, regex, choice, grammar (Lark); vLLM's names.
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.logit_bias is not None:  # JSON object keys are strings
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must map token ids to biases")
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and the accepted range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            # NaN passes `< 0`, then makes the sampler raise mid engine step
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:  # False for NaN too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs!r}")
        if self.stop is not None and any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.stop is not None and len(self.stop) > MAX_STOP:
            raise ValueError(f"stop takes at most {MAX_STOP} sequences, got {len(self.stop)}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:  # False for NaN too
                raise ValueError(f"{name} must be between -2 and 2, got {value!r}")
        if not 0 < self.repetition_penalty <= 1e6:  # False for NaN and inf too
            raise ValueError(
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty!r}"
            )
        if self.structured_outputs is not None:
            from pdserve.engine.grammar import check_spec

            check_spec(self.structured_outputs)
        for token, bias in (self.logit_bias or {}).items():
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError(
                    f"logit_bias maps token ids >= 0 to a bias in [-100, 100], got {token}: {bias}"
                )

    @property
    def penalized(self) -> bool:
        """True when the sampler must change the logits before picking (greedy too)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    def to_wire(self) -> dict[str, Any]:
        """The fields as a plain dict for control messages; the optional extras only when set,
        so a worker that predates them still decodes a request that does not use them."""
        out = dict(self.__dict__)
        for name, default in _EXTRAS.items():
            if out[name] == default:
                del out[name]
        return out

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of an n-choice request: one choice, seed + index."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])


MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_N = 128  # OpenAI's limit on choices
_EXTRAS: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    "n": 1,
    "structured_outputs": None,
}


def _token_key(key: Any) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


def check_prompt(ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """Raise ValueError, saying what to change, for a prompt the engine cannot run."""
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens but the context holds {max_model_len}; "
            "shorten the prompt (or raise max_model_len if the model allows)"
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Tokens of the prompt found in the prefix cache when the request was first admitted.
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None
    max_model_len: int = 1 << 62  # generation stops (length) when the context is full
    # Keep the KV blocks when finished (not aborted): a prefill worker's KV awaits transfer.
    hold_kv: bool = False
    # The conversation this turn belongs to: its KV is kept for the next turn when it finishes
    # (KVCacheManager.keep_turn; a decode worker's requests only).
    conversation: str | None = None
    # A held n-choice request (prefill side): the first token of choices 1..n-1, sampled from
    # the same logits as its own; the decode side forks the choices from them.
    fork_tokens: list[int] = field(default_factory=list)
    # Draft tokens proposed for the next step (speculation, engine/spec/); verified with the
    # last token in one chunk, then cleared. Never part of the sequence's tokens.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """`all_token_ids[start:stop]` without concatenating the whole sequence (a decode step
        asks for one token of a long one)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """Token-level stop conditions (stop strings need text and are checked by the engine)."""
        params = self.sampling_params
        last = self.output_token_ids[-1] if self.output_token_ids else None
        if last is not None and not params.ignore_eos and last in self.eos_token_ids:
            self.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if last is not None and params.stop_token_ids and last in params.stop_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
