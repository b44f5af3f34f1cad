"""The scheduler: a pure policy over plain data (no tensors, no I/O).

Life cycle of a request, by the queue names used below:
  1. `waiting`  — added, or preempted (at the front, so it resumes first);
  2. `running`  — admitted: holds KV blocks; each step it gets `num_tokens - num_computed_tokens`
                  tokens scheduled (a prompt chunk, or one decode token), bounded by the budget;
  3. finished   — stopped, length-capped or aborted: its blocks are freed at once.

Each `schedule()` fills a token budget (`max_num_batched_tokens`):
  * decode-first (default): running requests first — every running decode gets its token each
    step — then waiting prompts, chunked into what is left. Long prompts cannot stall decodes.
  * prefill-first (`decode_first=False`): if a waiting prompt can be admitted, the step runs
    prompts only and running decodes wait; the classic aggregated behaviour, kept as a baseline.
Stall-free batching (`prefill_budget`, as in Sarathi-Serve): with a budget function set and
decode-first on, each step schedules the running decodes first, then asks
`prefill_budget(num_decodes, decode_context_tokens, prompt_cached_tokens)` how many prompt
tokens (chunks of running prompts, then waiting prompts) may join them. The third argument is
the KV the next prompt chunk attends to, so a chunk deep into a 2k prompt is priced as such.
The function is computed outside from the TPOT SLO and the cost model (engine/step_budget.py),
so a step with decodes stays within the TPOT budget instead of carrying a whole 2048-token
chunk. A step without decodes has nothing to protect and uses the whole token budget.
When blocks run out, the most recently admitted running request is preempted by recompute: its
blocks are freed, `num_computed_tokens` resets to 0, and it goes back to the front of `waiting`
with the tokens it has generated, which are recomputed as part of its prompt later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.engine.hybrid_kv import KVManager
from pdserve.engine.kv_cache_manager import PrefixHit
from pdserve.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerPolicy:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    decode_first: bool = True
    # (decodes this step, their summed context tokens, tokens already cached for the next
    # prompt chunk) -> prompt tokens that may join them; None: prompts take whatever of
    # max_num_batched_tokens the decodes leave.
    prefill_budget: Callable[[int, int, int], int] | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.prefill_budget is not None and not self.decode_first:
            raise ValueError("a prefill budget needs decode_first (decodes are what it protects)")


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0] == num_computed_tokens before the step
    block_ids: list[int]  # the request's whole block table
    sample: bool  # this step reaches the last known token: sample the next one
    num_draft: int = 0  # of token_ids, the trailing draft tokens to verify (speculation)
    # the sliding layers' own block table (engine/hybrid_kv.py); None: they use block_ids
    sliding_block_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, policy: SchedulerPolicy, kv: KVManager) -> None:
        self.policy = policy
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # A cap below the policy's budget on what one step computes (None: the budget), set
        # between steps: under `--adaptive` a worker short of the host's cores takes small
        # steps, so that cores moving to it apply soon (a step keeps the count it started on)
        self.step_tokens: int | None = None
        self.num_fork_recomputes = 0
        self.num_draft_drops = 0  # decodes whose drafts found no free blocks (not verified)
        # Finished requests whose blocks are kept (`Request.hold_kv`) until `release_held`.
        self.held: dict[str, Request] = {}

    # ---- intake ------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.held:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        budget = self.policy.max_num_batched_tokens
        to_compute = request.num_tokens - request.num_computed_tokens
        if not self.policy.enable_chunked_prefill and to_compute > budget:
            raise ValueError(
                f"the prompt has {request.num_tokens} tokens but one step computes at most "
                f"{budget} and chunked prefill is off; enable chunked prefill or raise "
                "max_num_batched_tokens"
            )
        self.check_fits(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_fits(self, request: Request) -> None:
        """Raise ValueError if the request could ever need more blocks than the whole cache."""
        # Every token but the last generated one (sampled, never computed) needs a KV slot. A
        # request that can outgrow the whole cache would preempt itself forever, so refuse it.
        final_len = min(
            request.num_prompt_tokens + request.sampling_params.max_tokens, request.max_model_len
        )
        max_kv_tokens = max(request.num_tokens, final_len - 1)
        # Under a sliding window only the window's blocks are held at once (a step computes at
        # most max_num_batched_tokens tokens).
        if not self.kv.fits(max_kv_tokens, self.policy.max_num_batched_tokens):
            raise ValueError(
                f"request {request.request_id!r} needs more KV blocks than the cache holds "
                f"(up to {max_kv_tokens} tokens with max_tokens="
                f"{request.sampling_params.max_tokens}, {self.kv.num_blocks} blocks of "
                f"{self.kv.block_size}); shorten the prompt, lower max_tokens or give the cache "
                "more memory"
            )

    def add_prefilled(self, request: Request) -> None:
        """Admit a request whose KV for `num_computed_tokens` tokens is already in its blocks.

        A decode worker reserves the blocks (`KVCacheManager.reserve`), fills them from the
        wire, then calls this. The request joins `waiting` like any other; with only its last
        token uncomputed it schedules as a decode, needing no special path.
        """
        if not self.kv.has_request(request.request_id) or request.num_computed_tokens < 1:
            raise ValueError(f"request {request.request_id!r} has no reserved, filled KV blocks")
        self.add_request(request)

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int, int]]:
        """Start `child` (the same prompt, its own first token) from the parent's computed KV:
        the KV manager shares the full blocks and copies the partial one (returned as
        (KV group, source, copy) block ids for the engine to copy, one per group). The child
        runs at once, beside its parent (it is part of the same request, so `max_num_seqs` does
        not hold it back). When no block is free for the copy, the child waits to be recomputed
        like a preempted request (counted in `num_fork_recomputes`)."""
        if child.request_id in self.requests or child.request_id in self.held:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        self.requests[child.request_id] = child
        num_kv = child.num_computed_tokens
        try:
            copies = self.kv.fork_copies(parent.request_id, child.request_id, num_kv)
        except MemoryError:
            child.num_computed_tokens = 0
            child.status = RequestStatus.WAITING
            self.num_fork_recomputes += 1
            self.waiting.appendleft(child)
            return []
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        return copies

    def abort_request(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and free its blocks; unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            held = self.held.get(request_id)
            self.release_held(request_id)
            return held
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish for a reason found outside the scheduler (e.g. a stop string in the text)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, status)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.policy.max_num_batched_tokens
        if self.step_tokens and self.policy.enable_chunked_prefill:  # a whole prompt cannot wait
            budget = min(budget, self.step_tokens)
        if self.policy.prefill_budget is not None:
            self._schedule_stall_free(out, budget, self.policy.prefill_budget)
        elif self.policy.decode_first:
            budget = self._schedule_running(out, budget)
            if not out.preempted:
                self._schedule_waiting(out, budget)
        else:
            budget = self._schedule_running(out, budget, prefills_only=True)
            if not out.preempted:
                budget = self._schedule_waiting(out, budget)
            if not out.scheduled:
                self._schedule_running(out, budget)
        return out

    def _schedule_stall_free(
        self, out: SchedulerOutput, budget: int, prefill_budget: Callable[[int, int, int], int]
    ) -> None:
        """Decodes first; then prompt tokens up to what the budget function allows."""
        budget = self._schedule_running(out, budget, decodes_only=True)
        if out.preempted:
            return
        decodes = out.scheduled
        if decodes:
            context = sum(s.start_pos + 1 for s in decodes)
            cached = self._next_prompt_cached()
            drafts = sum(s.num_draft for s in decodes)  # verify rows cost as prompt tokens do
            budget = min(budget, max(0, prefill_budget(len(decodes), context, cached) - drafts))
        left = self._schedule_running(out, budget, prefills_only=True)
        if not out.preempted:
            self._schedule_waiting(out, left)

    def _next_prompt_cached(self) -> int:
        """Tokens the next prompt chunk will attend to: the first running prompt's computed
        tokens, else the waiting head's cached prefix (looked up without counting a query)."""
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens > 1:
                return request.num_computed_tokens
        if not self.waiting:
            return 0
        head = self.waiting[0]
        if head.num_computed_tokens:
            return head.num_computed_tokens
        return self.kv.peek_cached_prefix_tokens(head)

    def _schedule_running(
        self,
        out: SchedulerOutput,
        budget: int,
        prefills_only: bool = False,
        decodes_only: bool = False,
    ) -> int:
        already = {s.request_id for s in out.scheduled}
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            i += 1
            if request.request_id in already:
                continue
            is_decode = request.num_tokens - request.num_computed_tokens <= 1
            if (prefills_only and is_decode) or (decodes_only and not is_decode):
                continue
            num_new = self._num_to_schedule(request, budget)
            if num_new == 0:
                continue
            if num_new > 1 and is_decode and self.kv.allocate_slots(request, num_new) is None:
                request.spec_token_ids, num_new = [], 1  # drafts never preempt anyone
                self.num_draft_drops += 1
            block_ids = self._allocate_or_preempt(request, num_new, out)
            if block_ids is None:  # the request preempted itself
                break
            out.scheduled.append(self._scheduled(request, num_new, block_ids))
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.policy.max_num_seqs:
            request = self.waiting[0]
            prefix = (
                self.kv.find_cached_prefix(request)
                if request.num_computed_tokens == 0
                else PrefixHit([], 0)
            )
            remaining = request.num_tokens - request.num_computed_tokens - prefix.num_tokens
            num_new = min(remaining, budget)
            if num_new < remaining and not self._may_chunk(request):
                break
            block_ids = self.kv.allocate_slots(request, num_new, prefix)
            if block_ids is None:
                return self._schedule_holders(out, budget)
            self.waiting.popleft()
            self._admit(request, num_new, block_ids, prefix.num_tokens, out)
            budget -= num_new
        return budget

    def _schedule_holders(self, out: SchedulerOutput, budget: int) -> int:
        """The head of `waiting` found no memory: admit requests behind it that hold blocks.

        A request admitted on D with `add_prefilled` already holds its prompt's KV. Left queued
        behind a head that needs memory (say a preempted request recomputing), it would hold
        blocks the head may need and never release them: neither could run again. So requests
        that hold KV skip the queue; requests that need fresh memory keep their FIFO order.
        """
        for request in list(self.waiting)[1:]:
            if budget <= 0 or len(self.running) >= self.policy.max_num_seqs:
                break
            if not self.kv.has_request(request.request_id) or request.num_computed_tokens < 1:
                continue
            num_new = self._num_to_schedule(request, budget)
            block_ids = self.kv.allocate_slots(request, num_new) if num_new else None
            if block_ids is None:
                continue
            self.waiting.remove(request)
            self._admit(request, num_new, block_ids, 0, out)
            budget -= num_new
        return budget

    def _admit(
        self,
        request: Request,
        num_new: int,
        block_ids: list[int],
        cached_tokens: int,
        out: SchedulerOutput,
    ) -> None:
        if request.num_preemptions == 0:
            request.num_cached_tokens = cached_tokens
        request.num_computed_tokens += cached_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(self._scheduled(request, num_new, block_ids))

    def _num_to_schedule(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining == 1:  # a decode verifies its drafts in the same step (as many as fit)
            return min(1 + len(request.spec_token_ids), budget)
        if remaining > budget and not self._may_chunk(request):
            return 0
        return min(remaining, budget)

    def _may_chunk(self, request: Request) -> bool:
        """Whether the request's uncomputed tokens may be split over several steps.

        Without chunked prefill a prompt runs whole. But a preempted request recomputes its prompt
        plus the tokens it generated; once that outgrows the whole budget it could never run whole
        again, so it is recomputed in chunks rather than left waiting forever.
        """
        return self.policy.enable_chunked_prefill or (
            request.num_preemptions > 0 and request.num_tokens > self.policy.max_num_batched_tokens
        )

    def _allocate_or_preempt(
        self, request: Request, num_new: int, out: SchedulerOutput
    ) -> list[int] | None:
        """Allocate, preempting from the back of `running` until it fits (maybe `request`)."""
        while True:
            block_ids = self.kv.allocate_slots(request, num_new)
            if block_ids is not None:
                return block_ids
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _scheduled(self, request: Request, num_new: int, block_ids: list[int]) -> ScheduledRequest:
        start = request.num_computed_tokens
        real = min(num_new, request.num_tokens - start)
        drafts = request.spec_token_ids[: num_new - real]
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_slice(start, start + real) + drafts,
            start_pos=start,
            block_ids=block_ids,
            sliding_block_ids=self.kv.sliding_block_ids(request.request_id),
            sample=start + real == request.num_tokens,
            num_draft=len(drafts),
        )

    # ---- results -----------------------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]
    ) -> list[Request]:
        """Advance progress, append sampled tokens, finish what stopped; returns finished ones.

        A request that verified drafts gets a list: its accepted drafts and one more token.
        Each accepted draft's KV stands; the KV written for rejected drafts is past the
        computed tokens (rewritten later, never registered) and blocks holding only such
        positions are freed. Tokens after a stop are dropped, as if never sampled."""
        finished = []
        for s in out.scheduled:
            request = self.requests.get(s.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted between schedule() and now
            request.spec_token_ids = []
            request.num_computed_tokens += s.num_tokens - s.num_draft
            got = sampled.get(s.request_id)
            tokens = [got] if isinstance(got, int) else list(got or ())
            for i, token in enumerate(tokens):
                request.num_computed_tokens += i > 0  # the draft equal to `token` was computed
                request.append_token(token)
                status = request.check_stop()
                if status is not None:
                    self._finish(request, status)
                    finished.append(request)
                    break
            if s.num_draft and not request.finished:
                self.kv.trim(request.request_id, request.num_computed_tokens)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        del self.requests[request.request_id]
        if request.hold_kv and status != RequestStatus.FINISHED_ABORTED:
            self.held[request.request_id] = request  # a prefill worker's KV awaiting transfer
        else:
            if request.conversation and status != RequestStatus.FINISHED_ABORTED:
                self.kv.keep_turn(request.request_id, request.conversation)
            self.kv.free(request.request_id)

    def release_held(self, request_id: str) -> bool:
        """Free the KV kept by a finished `hold_kv` request (its transfer is acknowledged)."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.kv.free(request_id)
        return True
