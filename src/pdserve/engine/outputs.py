"""What the engine returns: vLLM-shaped `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # speculation (engine/spec/): drafts verified, of which accepted, steps that verified
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_steps: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # Tokens appended since the previous output of this request (for streaming).
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    error: str | None = None  # why the request failed (finish_reason "error"), if it did
    # (event, where, time.monotonic()) of the request's stages across workers, in time order.
    timeline: list[tuple[str, str, float]] = field(default_factory=list)
    # What the KV pool loaded for this request on this engine (its first output only):
    # lookup_at, hit_tokens, loaded_tokens, local_tokens, load_s (engine/pool_link.py).
    kv_pool: dict[str, float] | None = None
