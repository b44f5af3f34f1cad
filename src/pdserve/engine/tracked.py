"""What the engine keeps per live request beside the pure scheduler's `Request`: its text, its
detokenizer, grammar and metrics (`Tracked`), and how that becomes a `RequestOutput`."""

from __future__ import annotations

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.grammar import Matcher
from pdserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pdserve.engine.pool_link import PoolUse
from pdserve.engine.request import Request, RequestStatus

Sample = tuple[int, dict[int, float] | None]  # a sampled token and its logprobs
Samples = dict[str, list[Sample]]  # a step's tokens per request (several after drafts)


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

    def add_tokens(self, new_ids: list[int]) -> tuple[list[int], str]:
        """Feed the detokenizer; returns the ids and text this output adds. Several tokens at
        once (accepted drafts) go one by one when stop strings are set, and those after the
        token that completes a stop string are dropped from the request, as if never sampled."""
        if len(new_ids) <= 1 or not self.detok.stop:
            return new_ids, self.detok.add(new_ids)
        text = ""
        for i, token in enumerate(new_ids):
            text += self.detok.add([token])
            if self.detok.stop_hit is not None:
                self._drop(len(new_ids) - i - 1)
                return new_ids[: i + 1], text
        return new_ids, text

    def _drop(self, n: int) -> None:
        r = self.request
        if n == 0:
            return
        del r.output_token_ids[-n:]
        if self.logprobs is not None:
            del self.logprobs[r.num_output_tokens :]
        if r.finished:  # a token-level stop or the length cap came after the stop string
            r.status, r.stop_reason = RequestStatus.FINISHED_STOPPED, self.detok.stop_hit

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
