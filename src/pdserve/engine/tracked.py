"""What the engine keeps per live request beside the pure scheduler's `Request`: its text, its
detokenizer, grammar and metrics (`Tracked`), and how that becomes a `RequestOutput`."""

from __future__ import annotations

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.grammar import Matcher
from pdserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pdserve.engine.pool_link import PoolUse
from pdserve.engine.request import Request

Sample = tuple[int, dict[int, float] | None]  # a sampled token and its logprobs


class Tracked:
    """Engine-side state of a live request that the pure scheduler does not hold."""

    def __init__(
        self,
        request: Request,
        prompt: str | None,
        detok: IncrementalDetokenizer,
        index: int = 0,
        parent: str | None = None,
    ):
        self.request, self.prompt, self.detok = request, prompt, detok
        # choice `index` of an n-choice request; choices 1.. are forks of choice 0 (`parent`)
        self.index, self.parent = index, parent
        self.logprobs: list[dict[int, float]] | None = (
            [] if request.sampling_params.logprobs is not None else None
        )
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self.sent_tokens = 0
        self.matcher: Matcher | None = None  # structured outputs: the grammar's state
        self.pool_use: PoolUse | None = None  # what the KV pool loaded for it (reported once)

    @property
    def grammar_done(self) -> bool:
        return self.matcher is not None and self.matcher.done

    def output(self, new_ids: list[int], new_text: str) -> RequestOutput:
        """The request as it stands, with `new_ids` / `new_text` as this output's delta."""
        r = self.request
        self.metrics.num_cached_tokens = r.num_cached_tokens
        self.metrics.num_preemptions = r.num_preemptions
        pool, self.pool_use = self.pool_use, None  # with the request's first output only
        completion = CompletionOutput(
            index=self.index,
            text=self.detok.text,
            token_ids=list(r.output_token_ids),
            logprobs=self.logprobs,
            finish_reason=r.status.finish_reason,
            stop_reason=r.stop_reason,
        )
        return RequestOutput(
            self.parent or r.request_id,  # every choice reports under its request's id
            self.prompt,
            r.prompt_token_ids,
            [completion],
            r.finished,
            self.metrics,
            new_ids,
            new_text,
            kv_pool=pool.wire() if pool is not None else None,
        )


def choice_id(request_id: str, index: int) -> str:
    """The engine-internal id of choice `index` of an n-choice request."""
    return f"{request_id}#{index}"


class ReservedKV(list[int]):
    """`reserve_kv`'s answer: the block ids (a plain list to callers that want only them) and
    `cached_tokens`, the leading tokens whose KV is already in those blocks (prefix cache)."""

    def __init__(self, block_ids: list[int], cached_tokens: int) -> None:
        super().__init__(block_ids)
        self.cached_tokens = cached_tokens
