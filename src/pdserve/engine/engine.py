"""`LLMEngine`: requests in, one `step()` at a time, outputs out (the offline `LLM` is in llm.py).

A step: the scheduler picks tokens under its budget -> the model runner computes them and the
logits of rows to sample -> the sampler picks tokens -> the scheduler appends them and finishes
requests on token-level stops -> the detokenizer adds text and finishes requests on stop strings.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pdserve.config import EngineConfig
from pdserve.engine import engine_stats, kv_build, loader, model_build, step_log
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.grammar import GrammarBackend
from pdserve.engine.kv_access import KVAccess
from pdserve.engine.kv_cache import num_blocks_for_memory
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.pool_link import PoolLink
from pdserve.engine.request import Request, RequestStatus, SamplingParams, check_prompt
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Scheduler, SchedulerOutput, SchedulerPolicy
from pdserve.engine.spec.decoder import SpecDecoder
from pdserve.engine.step_budget import observe_step
from pdserve.engine.tracked import ReservedKV, Sample, Samples, Tracked, choice_id
from pdserve.kvpool.api import KVPool
from pdserve.spec_config import parse_speculative_config

log = logging.getLogger(__name__)


Prompt = str | list[int]


class LLMEngine(KVAccess):
    def __init__(
        self, config: EngineConfig, prefill_budget: Callable[[int, int, int], int] | None = None
    ) -> None:
        """`prefill_budget`: stall-free batching (scheduler.py, engine/step_budget.py)."""
        self.config = config
        mc, cc = config.model_config, config.cache_config
        if config.parallel_config.threads:
            torch.set_num_threads(config.parallel_config.threads)
        plan = model_build.plan(mc, cc.kv_cache_dtype)  # every refusal before the slow load
        self.device, self.dtype, self.source = plan.device, plan.dtype, plan.source
        self.quantization, self.decode_matmul = plan.quantization, plan.decode_matmul
        self.arch = loader.load_arch(self.source)
        # The KV as handed to another worker (read_kv): the model's dtype, whatever the cache's.
        self.kv_layout = self.arch.kv_layout(self.dtype)
        cache_layout = self.arch.kv_layout(plan.kv_dtype)
        self.tokenizer = loader.load_tokenizer(self.source)
        self.max_model_len = min(
            mc.max_model_len or self.arch.max_position_embeddings, self.arch.max_position_embeddings
        )
        self.model, self.prefill_choice = model_build.build_model(
            self.source, self.arch, mc, self.quantization, self.decode_matmul
        )
        self._cache_layout = cache_layout
        self._num_blocks = cc.num_blocks or num_blocks_for_memory(
            cache_layout, cc.block_size, cc.kv_cache_memory_gb
        )
        self._build_kv(groups=True)
        sc = config.scheduler_config
        self.scheduler = Scheduler(
            SchedulerPolicy(
                sc.max_num_batched_tokens,
                sc.max_num_seqs,
                sc.enable_chunked_prefill,
                sc.decode_first,
                prefill_budget,
            ),
            self.kv_manager,
        )
        self.runner = ModelRunner(self.model, self.cache, self.device, cc.attention)
        self.pool_link: PoolLink | None = None  # attach_pool
        self.sampler = Sampler(mc.seed)
        spec = parse_speculative_config(sc.speculative_config)  # P never speculates
        self.spec = SpecDecoder(spec) if spec and mc.phases != "prefill" else None
        self.grammars = GrammarBackend(self.tokenizer, self.arch.vocab_size)
        self._live: dict[str, Tracked] = {}
        self._reserved: dict[str, Tracked] = {}  # decode side: KV on its way from P
        self.counters = engine_stats.StepCounters()
        self._ids = itertools.count()
        self.step_log = step_log.StepLog()  # what the steps took (sim/validate.py reads it)
        self._children: dict[str, list[str]] = {}  # n-choice request -> its forked choices
        # Choices admitted with tokens to emit before any step (decode side, n > 1): forks'
        # first tokens (sampled on P, never emitted there) and choices that ended at once.
        self._pending: list[str] = []

    def _build_kv(self, groups: bool) -> None:
        """`groups=False`: one block table for every layer whatever the model (tests compare
        the layouts)."""
        self.cache, self.kv_manager = kv_build.build_kv(
            self.arch, self._cache_layout, self._num_blocks, self.config, self.device, groups
        )

    def attach_pool(self, pool: KVPool) -> None:
        """Load prompt prefixes from this KV pool and put every full block computed or received
        here into it (engine/pool_link.py). Its namespace must describe this engine's KV (every
        layer); a model with two KV groups keeps them, each group storing its own layers under
        a namespace naming them (engine/pool_group.py)."""
        if self.pool_link is not None:
            raise ValueError("a KV pool is attached already")
        self.pool_link = PoolLink(pool, self.cache, self.kv_manager)

    # ---- intake -----------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if not all(isinstance(t, int) for t in prompt):
            raise ValueError("a token prompt must be a list of integers")
        return None, list(prompt)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        hold_kv: bool = False,
    ) -> str:
        """Queue a request. `hold_kv` keeps its KV after it finishes, until `release_kv`."""
        tracked = self._new_request(prompt, params, request_id)
        tracked.request.hold_kv = hold_kv
        self.scheduler.add_request(tracked.request)
        self._live[tracked.request.request_id] = tracked
        return tracked.request.request_id

    def _new_request(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None
    ) -> Tracked:
        params.validate()
        bad_bias = [t for t in params.logit_bias or () if t >= self.arch.vocab_size]
        if bad_bias:
            raise ValueError(
                f"logit_bias token ids out of range [0, {self.arch.vocab_size}): {bad_bias[:5]}"
            )
        text, ids = self.tokenize(prompt)
        check_prompt(ids, self.max_model_len, self.arch.vocab_size)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._live or rid in self._reserved or rid in self.scheduler.held:
            raise ValueError(f"request id {rid!r} is already in use")
        request = Request(rid, ids, params, self.eos_token_ids, max_model_len=self.max_model_len)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop_strings)
        tracked = Tracked(request, text, detok)
        if params.structured_outputs is not None:
            tracked.matcher = self.grammars.matcher(params.structured_outputs)
        return tracked

    # ---- KV hand-off (used by prefill and decode workers) ------------------------------------
    def reserve_kv(
        self, prompt: Prompt, params: SamplingParams, request_id: str, num_kv_tokens: int
    ) -> ReservedKV | None:
        """Decode side: blocks for `num_kv_tokens` tokens of KV that will arrive from P.

        The prompt's cached prefix (whole blocks, at most `num_kv_tokens - 1` tokens) is reused:
        its KV is here already, so only tokens from `cached_tokens` on need to arrive. Returns
        the block ids (a list, with `.cached_tokens`), or None when memory is short (nothing is
        reserved then).
        """
        tracked = self._new_request(prompt, params, request_id)
        if not 0 < num_kv_tokens < self.max_model_len:
            raise ValueError(f"num_kv_tokens must be in [1, {self.max_model_len})")
        self.scheduler.check_fits(tracked.request)  # never wait for memory that cannot exist
        complete = self.arch.kv_complete_from(num_kv_tokens)  # P sends window layers their window
        got = self.kv_manager.reserve_with_prefix(
            tracked.request, num_kv_tokens + 1, num_kv_tokens - 1, complete
        )
        if got is None:
            return None
        self._reserved[request_id] = tracked
        return ReservedKV(got[0], got[1])

    def admit_prefilled(
        self,
        request_id: str,
        output_token_ids: list[int],
        num_kv_tokens: int,
        fork_tokens: Sequence[int] = (),
    ) -> None:
        """Decode side: the KV of the first `num_kv_tokens` tokens is in the reserved blocks.

        `fork_tokens`: an n-choice request's first tokens of choices 1..n-1 (sampled on P from
        the prompt's logits); those choices are forked here from the same KV, no copy but the
        last partial block."""
        tracked = self._reserved.pop(request_id)
        request = tracked.request
        request.output_token_ids = list(output_token_ids)
        if num_kv_tokens != request.num_tokens - 1:
            self.kv_manager.free(request_id)
            raise ValueError(
                f"{request_id}: {num_kv_tokens} KV tokens for {request.num_tokens} tokens; "
                "all but the last must be computed"
            )
        request.num_computed_tokens = num_kv_tokens
        if tracked.matcher is not None:
            try:  # the grammar's state crosses P -> D by replaying P's tokens
                tracked.matcher.replay(output_token_ids)
            except ValueError:
                self.kv_manager.free(request_id)
                raise
        tracked.detok.add(list(output_token_ids))  # P already emitted this text
        tracked.sent_tokens = len(output_token_ids)
        if len(fork_tokens) != request.sampling_params.n - 1 or (
            fork_tokens and len(output_token_ids) != 1
        ):
            self.kv_manager.free(request_id)
            raise ValueError(
                f"{request_id}: n={request.sampling_params.n} needs {request.sampling_params.n - 1}"
                f" fork tokens after one first token, got {len(fork_tokens)}"
            )
        self.scheduler.add_prefilled(request)
        self._live[request_id] = tracked
        for i, token in enumerate(fork_tokens, start=1):
            child = self._fork(tracked, i, token, num_kv_tokens)
            self._pending.append(child.request.request_id)  # P did not emit its first token
        if fork_tokens:
            # P hands an n-choice request over whatever its first tokens were: choice 0 may
            # have ended on its first token (forks were taken from its KV above)
            status = request.check_stop()
            if status is None and tracked.grammar_done:
                status = RequestStatus.FINISHED_STOPPED
            if status is not None or tracked.detok.stop_hit is not None:
                if status is not None:
                    self.scheduler.finish_request(request_id, status)
                self._pending.append(request_id)

    def mark_turn(self, request_id: str, conversation: str) -> None:
        """Make a queued or reserved request a turn of `conversation`: its KV is kept for the
        conversation's next turn when it finishes (KVCacheManager.keep_turn)."""
        tracked = self._live.get(request_id) or self._reserved[request_id]
        self.kv_manager.mark_turn(tracked.request, conversation)

    def cancel_reserved(self, request_id: str) -> bool:
        if self._reserved.pop(request_id, None) is None:
            return False
        self.kv_manager.free(request_id)
        return True

    def release_kv(self, request_id: str) -> bool:
        """Prefill side: the transfer is acknowledged (or its lease expired); free the KV."""
        return self.scheduler.release_held(request_id)

    def held_request(self, request_id: str) -> Request | None:
        return self.scheduler.held.get(request_id)

    def abort_request(self, request_id: str) -> None:
        """Drop a request wherever it is (queued, running, reserved or held); frees its KV."""
        for child in self._children.pop(request_id, ()):
            self.scheduler.abort_request(child)
            self._forget(child)
        self.scheduler.abort_request(request_id)
        self.cancel_reserved(request_id)
        self._forget(request_id)

    def is_done(self, request_id: str) -> bool:
        """Whether every choice of the request has ended (n > 1 ends choice by choice)."""
        return request_id not in self._live and request_id not in self._children

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        begin, began_at = time.perf_counter(), time.monotonic()
        early = self._emit_pending()
        link = self.pool_link
        if link is not None and self.scheduler.waiting:
            used = link.prefetch(
                list(self.scheduler.waiting), self.scheduler.policy.max_num_batched_tokens
            )
            for rid, use in used.items():
                self._live[rid].pool_use = use
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self._live)
        out = self.scheduler.schedule()
        if link is not None:
            link.release()
        if out.is_empty:
            return early
        self.counters.count_step(out)
        now = time.monotonic()
        for s in out.scheduled:
            m = self._live[s.request_id].metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        t0 = time.perf_counter()
        sampled, firsts = self._run(out)
        elapsed = time.perf_counter() - t0
        observe_step(self.scheduler.policy.prefill_budget, out, elapsed)
        if self.spec is not None:
            self.spec.observe_step(out, elapsed)
        if link is not None:  # the KV is written; finishing requests still hold their blocks
            link.after_step(set(out.preempted))
        # Fork before the parent's update: a parent that stops on its first token frees its KV.
        for rid, tokens in firsts.items():
            self._fork_choices(rid, tokens, sampled)
        self.scheduler.update_from_output(out, {k: [t for t, _ in v] for k, v in sampled.items()})
        outputs = early + self._collect(out, sampled)
        whole = time.perf_counter() - begin  # the whole step(), as the profiler times it
        self.step_log.add(step_log.record(out, began_at, whole, torch.get_num_threads()))
        return outputs

    def _emit_pending(self) -> list[RequestOutput]:
        pending, self._pending = self._pending, []
        now = time.monotonic()
        return [self._emit(self._live[rid], now) for rid in pending if rid in self._live]

    def _run(self, out: SchedulerOutput) -> tuple[Samples, Samples]:
        """Sampled (token, logprobs) per request (several after verified drafts), and for
        n-choice requests sampling their first token, the first (token, logprobs) of choices
        1..n-1 from the same logits row."""
        result, verified = self.runner.execute(out), Samples()
        if self.spec is not None:
            result, verified = self.spec.verify(result, self._live, self.sampler)
        if not result.request_ids:
            return verified, {}
        tracked = [self._live[r] for r in result.request_ids]
        requests = [t.request for t in tracked]
        params = [r.sampling_params for r in requests]  # choice 0 samples with the seed
        histories = [(r.prompt_token_ids, r.output_token_ids) for r in requests]
        masks = [t.matcher.allowed() if t.matcher is not None else None for t in tracked]
        samples = self.sampler.sample(
            result.logits, result.request_ids, params, histories, masks=masks
        )
        sampled = {
            r: [(s.token_id, s.logprobs)] for r, s in zip(result.request_ids, samples, strict=True)
        }
        for t, s in zip(tracked, samples, strict=True):
            if t.matcher is not None:
                t.matcher.accept(s.token_id)
                if t.matcher.error is not None and not t.matcher.reported:
                    t.matcher.reported = True
                    self.counters.grammar_errors += 1
                    log.warning("%s: grammar gave up: %s", t.request.request_id, t.matcher.error)
        firsts = {}
        for row, r in enumerate(requests):
            n = r.sampling_params.n
            if n > 1 and not r.output_token_ids and r.request_id not in self._children:
                rids = [choice_id(r.request_id, i) for i in range(1, n)]
                more = self.sampler.sample(
                    result.logits[row : row + 1].expand(n - 1, -1),
                    rids,
                    [r.sampling_params.for_choice(i) for i in range(1, n)],
                    [(r.prompt_token_ids, ())] * (n - 1),
                    masks=[masks[row]] * (n - 1),  # every choice starts the grammar afresh
                )
                firsts[r.request_id] = [(s.token_id, s.logprobs) for s in more]
        return sampled | verified, firsts

    def _fork_choices(self, rid: str, firsts: list[Sample], sampled: Samples) -> None:
        """Start choices 1..n-1 of `rid` from its prompt's KV, each with its first token; on a
        prefill worker (held KV) only note the tokens: the decode worker forks them."""
        tracked = self._live[rid]
        request = tracked.request
        if request.hold_kv:
            request.fork_tokens = [token for token, _ in firsts]
            self._children[rid] = []
            return
        for i, (token, logprobs) in enumerate(firsts, start=1):
            child = self._fork(tracked, i, token, request.num_tokens)
            sampled[child.request.request_id] = [(token, logprobs)]  # _collect emits it

    def _fork(self, parent: Tracked, index: int, token: int, num_kv: int) -> Tracked:
        """Choice `index` of `parent`: its prompt's first `num_kv` tokens of KV shared."""
        p = parent.request
        rid = choice_id(p.request_id, index)
        request = Request(
            rid,
            p.prompt_token_ids,
            p.sampling_params.for_choice(index),
            p.eos_token_ids,
            arrival_time=p.arrival_time,
            output_token_ids=[token],
            num_computed_tokens=num_kv,
            max_model_len=p.max_model_len,
        )
        stop = p.sampling_params.stop_strings
        child = Tracked(
            request,
            parent.prompt,
            IncrementalDetokenizer(self.tokenizer, p.prompt_token_ids, stop),
            index,
            p.request_id,
        )
        if p.sampling_params.structured_outputs is not None:
            child.matcher = self.grammars.matcher(p.sampling_params.structured_outputs)
            child.matcher.replay([token])
        self._live[rid] = child
        self._children.setdefault(p.request_id, []).append(rid)
        for group, src, dst in self.scheduler.fork(p, request):
            self.cache.copy_block(src, dst, group)
        self.counters.forked_choices += 1
        status = request.check_stop()
        if status is None and child.grammar_done:
            status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            self.scheduler.finish_request(rid, status)
        return child

    def _collect(self, out: SchedulerOutput, sampled: Samples) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for rid, samples in sampled.items():
            tracked = self._live[rid]
            if tracked.logprobs is not None:
                tracked.logprobs.extend(lp for _, lp in samples if lp is not None)
            outputs.append(self._emit(tracked, now))
        return outputs

    def _emit(self, tracked: Tracked, now: float) -> RequestOutput:
        """The request's output for its tokens since the last one; stop strings end it."""
        request, rid = tracked.request, tracked.request.request_id
        tracked.metrics.first_token_time = tracked.metrics.first_token_time or now
        new_ids, new_text = tracked.add_tokens(request.output_token_ids[tracked.sent_tokens :])
        tracked.sent_tokens = request.num_output_tokens
        if tracked.detok.stop_hit is not None and not request.finished:
            request.stop_reason = tracked.detok.stop_hit
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        elif tracked.grammar_done and not request.finished:  # the document is complete
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        output = tracked.output(new_ids, new_text)
        if request.finished:
            tracked.metrics.finished_time = now
            self._forget(rid)
        return output

    def _forget(self, rid: str) -> None:
        tracked = self._live.pop(rid, None)
        if self.spec is not None:
            self.spec.forget(rid)
        if self.pool_link is not None:
            self.pool_link.forget(rid)
        self.sampler.forget(rid)
        parent = rid if tracked is None or tracked.parent is None else tracked.parent
        choices = self._children.get(parent)
        done = parent not in self._live and not any(c in self._live for c in choices or ())
        if choices is not None and done:
            del self._children[parent]  # the whole n-choice request is done

    # ---- introspection ----------------------------------------------------------------------
    def stats_record(self) -> engine_stats.EngineStats:
        """This engine's settings and counters now."""
        kv_dtype = str(self.cache.dtype).removeprefix("torch.")
        return engine_stats.record(
            (self.quantization, kv_dtype, self.decode_matmul),
            self.prefill_choice,
            self.model.step_rows,
            self.scheduler,
            self.kv_manager,
            self.counters,
            len(self._reserved),
            self.pool_link,
            self.spec.stats(self.scheduler.num_draft_drops) if self.spec is not None else {},
        )

    def stats(self) -> dict[str, Any]:
        """Counters for /admin/workers and the metrics: `stats_record()` as one flat dict."""
        return self.stats_record().as_dict()
