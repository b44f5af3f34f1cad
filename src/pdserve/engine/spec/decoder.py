"""`SpecDecoder`: the engine's speculation, around the scheduler and the sampler.

Before a step it proposes drafts for the running decodes (`propose`: prompt lookup, ngram.py)
into `Request.spec_token_ids`; the scheduler gives each such decode a (1 + k)-token chunk
(counting the drafts against the token budget and the KV slots), the model runner returns
its 1 + k rows of logits, and `verify` turns them into the tokens the step yields
(rejection.py) before the engine samples the other requests as usual. The scheduler then
appends those tokens and rolls the rejected drafts' KV back (scheduler.update_from_output).

Not drafted, each counted: every decode of a step whose decode batch reaches
`disable_by_batch_size` (`disabled_steps`: verify rows no longer pay there) and requests with
a grammar (`grammar_skips`, per step: the grammar would have to be advanced per draft).
Below that batch, a step's drafts per request are capped by `DraftPacer` (pacing.py) at the k
that yields the most tokens per second of step, from the measured step time per row count and
the acceptance rate (`paced_steps`: steps capped below num_speculative_tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pdserve.engine.model_runner import StepResult
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.spec import ngram, rejection
from pdserve.engine.spec.pacing import DraftPacer
from pdserve.engine.tracked import Sample, Tracked
from pdserve.spec_config import SpeculativeConfig


@dataclass
class SpecCounters:
    draft_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # of which accepted
    steps: int = 0  # request-steps that verified drafts
    disabled_steps: int = 0  # engine steps not drafted: the decode batch reached the crossover
    grammar_skips: int = 0  # request-steps not drafted: the request has a grammar
    # accepted_at[i]: verify steps whose draft i + 1 was accepted
    accepted_at: list[int] = field(default_factory=list)

    def as_stats(self) -> dict[str, Any]:
        return {f"spec_{k}": v for k, v in asdict(self).items()}


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.counters = SpecCounters(accepted_at=[0] * config.num_speculative_tokens)
        self._states: dict[str, ngram.DraftState] = {}
        self.pacer = DraftPacer(config.num_speculative_tokens)

    def stats(self, memory_skips: int) -> dict[str, Any]:
        """`spec_*` counters; `memory_skips`: decodes whose drafts found no free KV blocks
        (the scheduler's count: drafts never preempt a request)."""
        return {
            **self.counters.as_stats(),
            "spec_memory_skips": memory_skips,
            "spec_paced_steps": self.pacer.capped_steps,
        }

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A step's measured time, for the pacer's price of verify rows."""
        pure = all(s.num_tokens == 1 + s.num_draft for s in out.scheduled)
        self.pacer.observe_step(out.num_batched_tokens, seconds, pure)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def propose(self, running: Iterable[Request], live: Mapping[str, Tracked]) -> None:
        """Set each running decode's drafts for the coming step (empty when none)."""
        c = self.config
        decodes = [
            r for r in running if r.num_tokens - r.num_computed_tokens == 1 and r.output_token_ids
        ]
        if len(decodes) >= c.disable_by_batch_size:
            self.counters.disabled_steps += 1
            for r in decodes:
                r.spec_token_ids = []
            return
        cap = self.pacer.cap(len(decodes)) if decodes else 0
        for r in decodes:
            r.spec_token_ids = []
            tracked = live.get(r.request_id)
            if tracked is None:
                continue
            if tracked.matcher is not None:
                self.counters.grammar_skips += 1
                continue
            state = self._states.get(r.request_id)
            if state is None:
                state = self._states[r.request_id] = ngram.DraftState(c.num_speculative_tokens)
            # never past max_tokens or the context: the step also yields one token of its own
            room = min(
                r.sampling_params.max_tokens - r.num_output_tokens, r.max_model_len - r.num_tokens
            )
            k = min(state.k, room - 1, cap)
            if k < 1:
                if cap > 0:  # the request's own acceptance said no: let it recover
                    state.observe(0, 0)
                continue
            tokens = state.sync(r.prompt_token_ids, r.output_token_ids)
            drafts = ngram.propose(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)
            r.spec_token_ids = drafts.tolist()

    def verify(
        self, result: StepResult, live: Mapping[str, Tracked], sampler: Sampler
    ) -> tuple[StepResult, dict[str, list[Sample]]]:
        """The tokens of every request that verified drafts this step, and the step's result
        reduced to the others (one row each), for the engine's usual sampling."""
        if result.num_drafts is None:
            return result, {}
        keep_ids: list[str] = []
        keep_rows: list[int] = []
        verified: dict[str, list[Sample]] = {}
        row = 0
        for rid, k in zip(result.request_ids, result.num_drafts, strict=True):
            if k == 0:
                keep_ids.append(rid)
                keep_rows.append(row)
                row += 1
                continue
            tracked = live[rid]
            r = tracked.request
            drafts = r.spec_token_ids[:k]
            history = (r.prompt_token_ids, r.output_token_ids)
            rows = result.logits[row : row + 1 + k]
            p = r.sampling_params
            stops = {*(p.stop_token_ids or ()), *(() if p.ignore_eos else r.eos_token_ids)}
            samples = rejection.verify(sampler, rid, p, history, drafts, rows, stops)
            verified[rid] = samples
            # a correction never equals its draft: the accepted drafts are the matching prefix
            accepted = sum(1 for (t, _), d in zip(samples, drafts, strict=False) if t == d)
            self._count(tracked, k, accepted)
            row += 1 + k
        index = torch.tensor(keep_rows, dtype=torch.long, device=result.logits.device)
        return StepResult(keep_ids, result.logits.index_select(0, index)), verified

    def _count(self, tracked: Tracked, drafted: int, accepted: int) -> None:
        c = self.counters
        c.draft_tokens += drafted
        c.accepted_tokens += accepted
        c.steps += 1
        self.pacer.observe_verify(drafted, accepted)
        for i in range(accepted):
            c.accepted_at[i] += 1
        m = tracked.metrics
        m.spec_draft_tokens += drafted
        m.spec_accepted_tokens += accepted
        m.spec_steps += 1
        state = self._states.get(tracked.request.request_id)
        if state is not None:
            state.observe(drafted, accepted)
