"""The routing decision, one copy for the router (routing.py) and the simulator (sim/cluster.py).

Pure: no sockets, no clock, no counters. Callers hand in the routable workers by role (anything
with the `Candidate` fields: the router's `WorkerState`, the simulator's `SimWorker`), the time,
and what each worker caches; they get back the worker(s) an attempt goes to, and book its work
on their loads with `book`. Naming the route in timelines and counters stays with the caller.

  * `pick`     without a planner: the pools' policies pick a P/D pair, else a colocated worker,
               else any worker whole (a pool is empty: degrade to whole requests);
  * `plan`     with a planner: `SloPlanner.decide` over every route of the healthy pools;
  * `cached_tokens`  the prompt tokens each worker caches: the prefix index, plus the affinity
               of a conversation's last turn while the index has not heard from its worker;
  * `book`     the attempt's predicted prefill and decode work, added to the workers' loads;
  * `history_tokens`, `follow_up_local`  a conversation's follow-up without a planner: what the
               D keeping its last turn holds, and whether its new part is prefilled there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

from pdserve.router import slo
from pdserve.router.loads import Job, WorkerLoad
from pdserve.router.policies import Policy
from pdserve.router.policies import WorkerLoad as PolicyLoad
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.worker_stats import WorkerStats

ROLES = ("prefill", "decode", "colocated")


class Candidate(Protocol):
    """What a decision reads about one routable worker."""

    @property
    def worker_id(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def outstanding(self) -> int: ...  # requests sent there and not seen finish
    @property
    def stats(self) -> WorkerStats: ...  # its last report (the policies read `waiting`)
    @property
    def load(self) -> WorkerLoad: ...  # the planner's picture of its queue (`book`)


W = TypeVar("W", bound=Candidate)


def pick(
    pools: Mapping[str, Sequence[W]], policies: Mapping[str, Policy]
) -> tuple[W, W | None] | None:
    """The policies' choice; None: no routable worker."""
    if pools["prefill"] and pools["decode"]:
        return choose(policies["prefill"], pools["prefill"]), choose(
            policies["decode"], pools["decode"]
        )
    for role in ("colocated", "decode", "prefill"):
        if pools[role]:
            return choose(policies[role], pools[role]), None
    return None


def choose(policy: Policy, pool: Sequence[W]) -> W:
    loads = [PolicyLoad(w.worker_id, w.outstanding, w.stats.waiting) for w in pool]
    chosen = policy.pick(loads)
    return next(w for w in pool if w.worker_id == chosen.worker_id)


def plan(
    planner: slo.SloPlanner,
    pools: Mapping[str, Sequence[W]],
    prompt_len: int,
    max_tokens: int,
    now: float,
    *,
    cached: dict[str, int],
    pooled: dict[str, int] | None = None,
    admit_all: bool = False,
    streams: int = 1,
) -> tuple[tuple[W, W | None] | None, slo.Decision]:
    """The planner's route and its decision; no pair: refused (`decision.reject`). The caller
    checks first that some pool has a worker (with none, nothing is predicted or counted)."""
    routes = planner.routes(*([w.worker_id for w in pools[r]] for r in ROLES))
    byid = {w.worker_id: w for r in ROLES for w in pools[r]}
    loads = {wid: w.load for wid, w in byid.items()}
    decision = planner.decide(
        prompt_len,
        max_tokens,
        routes,
        loads,
        cached,
        now,
        admit_all=admit_all,
        streams=streams,
        pooled=pooled,
    )
    if decision.chosen is None:
        return None, decision
    route = decision.chosen.route
    second = byid[route.decode] if route.decode is not None else None
    return (byid[route.first], second), decision


def cached_tokens(
    prefix: PrefixIndex,
    prompt: list[int],
    block_size: int,
    worker_ids: list[str],
    last_turn: tuple[str, list[int]] | None = None,
) -> dict[str, int]:
    """Prompt tokens each worker already caches: the index of its published block hashes; for
    the worker that served this conversation's last turn (`last_turn`: its id and that turn's
    tokens), at least what that turn left there when the index has not heard from it (affinity
    survives a lagging index)."""
    cached = prefix.match(prompt, block_size, worker_ids)
    if last_turn is None:
        return cached
    keeper, tokens = last_turn
    if keeper in worker_ids and prefix.needs_resync(keeper):
        common = 0
        for a, b in zip(tokens, prompt, strict=False):
            if a != b:
                break
            common += 1
        cached[keeper] = max(cached.get(keeper, 0), common // block_size * block_size)
    return cached


def history_tokens(last_turn: list[int], prompt: list[int], block_size: int) -> int:
    """KV tokens of a conversation's last turn (`last_turn`: its prompt and answer, all but the
    last token computed) that `prompt` continues, in whole blocks: what the worker keeping
    that turn holds of this prompt."""
    n = min(len(last_turn), len(prompt)) - 1
    common = 0
    while common < n and last_turn[common] == prompt[common]:
        common += 1
    return common // block_size * block_size


def follow_up_local(prompt_len: int, cached: int, local_tokens: int) -> bool:
    """Whether a follow-up is prefilled whole on the decode worker holding its history (the
    local route) rather than on P: it holds some of it, and the tokens it does not hold are
    at most `local_tokens` (0: never). Below that, prefilling them there costs less than P's
    prefill of the whole prompt (its cache lacks the answers) plus the transfer."""
    return cached > 0 and prompt_len - cached <= local_tokens


def book(
    planner: slo.SloPlanner,
    rid: str,
    loads: tuple[WorkerLoad, WorkerLoad | None],
    tokens: int,
    max_new: int,
    now: float,
    pred: slo.Prediction | None,
    *,
    pooled: int | None = None,
    streams: int = 1,
) -> None:
    """Book an attempt of `tokens` prompt tokens (a retry's include those already sent) and up
    to `max_new` more on the loads of its (first, decode) workers. `pooled`: what the first
    worker loads from its KV pool (default: the prediction's; a route the caller chose has none).
    `streams`: sequences decoding (n choices decode as n)."""
    first, second = loads
    out = max(1, min(max_new, planner.expected_output))
    cached = pred.cached_first if pred is not None else 0
    if pooled is None:
        pooled = pred.pooled_first if pred is not None else 0
    prefill = planner.prefill_time(tokens, cached, first, pooled)
    step = planner.model.prefill_s(min(tokens - cached, planner.token_budget), cached)
    if second is None:
        first.add(Job(rid, prefill, tokens, out, True, now, streams=streams, step_s=step))
        return
    first.add(Job(rid, prefill, 0, 0, False, now, step_s=step))
    second.add(Job(rid, 0.0, tokens, out, True, now, streams=streams))


def route_kind(first_role: str, remote: bool, pred: slo.Prediction | None, forced: bool) -> str:
    """The route's name: the planner's, else remote (a P/D pair), else for a worker the caller
    chose (a recovery) recompute (on D) or local; else colocated, or fallback (a pool is empty)."""
    if pred is not None:
        return pred.route.kind
    if remote:
        return "remote"
    if forced:
        return "recompute" if first_role == "decode" else "local"
    return "colocated" if first_role == "colocated" else "fallback"


def whole_on_decode(n: int, max_tokens: int, logprobs: int | None) -> bool:
    """n one-token choices end on P (nothing to hand over), and P does not send the logprobs of
    the choices' first tokens: D runs these whole (one prefill there)."""
    return n > 1 and (max_tokens == 1 or logprobs is not None)
