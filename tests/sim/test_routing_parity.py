"""The router and the simulator make the same routing decisions (router/decide.py): the same
workers, worker stats, cached prefixes and request sequence go through the router's `Routing`
and the simulator's `Simulation._arrive`, and every choice (route, workers, rejection,
predicted TTFT/TPOT) must be equal. Nothing runs in between, so each side's booked loads and
outstanding counts carry from one decision to the next, as they do in service."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass

import pytest

from pdserve.costmodel.model import CostModel
from pdserve.engine.block_pool import hash_full_blocks
from pdserve.engine.request import Request, SamplingParams
from pdserve.router import slo
from pdserve.router.events import RouterEvents
from pdserve.router.flight import Flight, RequestError
from pdserve.router.links import Links
from pdserve.router.routing import Routing
from pdserve.router.worker_stats import WorkerStats
from pdserve.sim.cluster import Simulation
from pdserve.sim.records import Record, SimConfig, SimRequest
from pdserve.sim.steptime import Link
from pdserve.workers import messages as m

BLOCK = 16
MODEL = CostModel((0.002, 1e-4, 0.0), (0.01, 2e-4, 0.0), (0.001, 1e9))


@dataclass(frozen=True)
class Step:
    """A fixed step model: the simulator needs one, but no step runs here."""

    kv_bytes_per_token: float = 100.0
    layers: int = 1
    gpus: int = 1

    def step_s(self, rows: object) -> float:
        return 0.01

    def receive_s(self, tokens: int) -> float:
        return 0.0

    def kv_tokens(self) -> int:
        return 1 << 16


@dataclass(frozen=True)
class Case:
    config: SimConfig
    waiting: dict[str, int]  # each worker's reported queue
    cached: dict[str, list[int]]  # tokens whose full blocks a worker caches (its KVEvents)


def _prompt(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


SHARED = _prompt(64, base=5000)  # a prefix a worker caches
# (arrival, prompt, max_tokens): short and long prompts, some sharing the cached prefix
REQUESTS = [
    (0.00, _prompt(40), 32),
    (0.01, SHARED + _prompt(20, 9000), 16),
    (0.02, _prompt(600, 2000), 64),
    (0.02, _prompt(8), 200),
    (0.05, SHARED + _prompt(90, 7000), 8),
    (0.06, _prompt(3000, 3000), 32),
    (0.07, _prompt(120, 4000), 128),
    (0.07, _prompt(16, 6000), 1),
    (0.08, _prompt(900, 8000), 48),
    (0.10, SHARED, 20),
]

CASES = {
    "least_outstanding": Case(
        SimConfig(prefill=2, decode=2, router_policy="least_outstanding"),
        {"P0": 2, "D1": 1},
        {},
    ),
    "round_robin_colocated": Case(SimConfig(colocated=3), {"C1": 4}, {}),
    "planner_conditional": Case(
        SimConfig(
            prefill=2,
            decode=2,
            colocated=1,
            planner=True,
            disaggregation="conditional",
            prefix_routing=True,
            expected_output=64,
        ),
        {},
        {"D1": SHARED, "P1": SHARED[:32]},
    ),
    "planner_admission": Case(
        SimConfig(
            prefill=1,
            decode=2,
            planner=True,
            admission=True,
            slo_ttft_s=0.2,
            slo_tpot_s=0.05,
            prefix_routing=True,
        ),
        {},
        {"P0": SHARED},
    ),
}


def _simulator(case: Case) -> Simulation:
    sim = Simulation(case.config, Step(), Link(1e9, 1e-4), planner_model=MODEL)  # type: ignore[arg-type]
    for w in sim.workers:
        for i in range(case.waiting.get(w.wid, 0)):  # its queue: requests not yet scheduled
            w.sched.add_request(Request(f"q{i}", [1, 2, 3], SamplingParams(max_tokens=1)))
        if w.wid in case.cached:
            sim.prefix.apply(_snapshot(w.wid, case.cached[w.wid]))
    return sim


def _snapshot(wid: str, tokens: list[int]) -> m.KVEvents:
    return m.KVEvents(wid, 0, BLOCK, hash_full_blocks(tokens, BLOCK), [], True)


def _router(case: Case, sim: Simulation, clock: list[float]) -> Routing:
    """A router over workers named and reporting as the simulator's (no worker behind them)."""
    links = Links([f"inproc://parity-{w.wid}" for w in sim.workers], None, RouterEvents(None))
    for w, s in zip(links.workers, sim.workers, strict=True):
        w.info = m.WorkerInfo(s.wid, s.role, 0, "", BLOCK, 1024, b"", "model")
        w.healthy = True
        w.stats = WorkerStats(waiting=case.waiting.get(s.wid, 0))
    cfg = case.config
    # the simulator's planner as built, before any decision (the same settings and model)
    planner = copy.deepcopy(sim.planner)
    routing = Routing(
        links,
        RouterEvents(None),
        planner,
        policy=cfg.router_policy,
        prefix_routing=cfg.prefix_routing,
        clock=lambda: clock[0],
    )
    for wid, tokens in case.cached.items():
        routing.prefix.apply(_snapshot(wid, tokens))
    return routing


Choice = tuple[str, str, float | None, float | None]  # route or rejection, workers, predictions


def _router_choices(routing: Routing, clock: list[float]) -> list[Choice]:
    out: list[Choice] = []
    for i, (t, prompt, max_tokens) in enumerate(REQUESTS):
        clock[0] = t
        params = SamplingParams(max_tokens=max_tokens)
        flight = Flight(f"r{i}", prompt, params, asyncio.Queue())
        try:
            routing.route(flight, prompt, admit=True, only=None)
        except RequestError as e:
            out.append((f"rejected_{e.code}", "", None, None))
            continue
        assert flight.pair is not None
        workers = "->".join(w.worker_id for w in flight.pair if w is not None)
        pred = flight.prediction
        out.append((flight.route, workers, *((pred.ttft_s, pred.tpot_s) if pred else (None, None))))
    return out


def _sim_choices(sim: Simulation) -> list[Choice]:
    out: list[Choice] = []
    for i, (t, prompt, max_tokens) in enumerate(REQUESTS):
        req = SimRequest(f"r{i}", t, prompt, max_tokens)
        sim.records[req.rid] = rec = Record(req.rid, len(prompt), max_tokens, None)
        sim.now = t
        sim._arrive(req)  # the router's half of an arrival; the workers' events never run
        if rec.rejected is not None:
            out.append((f"rejected_{rec.rejected}", "", None, None))
            continue
        out.append((rec.route, "->".join(rec.workers), rec.predicted_ttft, rec.predicted_tpot))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_the_router_and_the_simulator_choose_alike(name: str) -> None:
    case = CASES[name]
    sim = _simulator(case)
    clock = [0.0]
    routing = _router(case, sim, clock)
    try:
        router, simulated = _router_choices(routing, clock), _sim_choices(sim)
    finally:
        routing.links.close()
    assert router == simulated
    # the sequence exercises the decision: more than one worker and route is chosen
    assert len({c[1] for c in router if c[1]}) > 1
    if case.config.planner:
        loads = {w.wid: sorted(w.load.jobs) for w in sim.workers}
        booked = {w.worker_id: sorted(w.load.jobs) for w in routing.links.workers}
        assert booked == loads and any(loads.values())


def test_the_admission_case_rejects_some_and_admits_some() -> None:
    """So that the parity above covers both outcomes of admission."""
    case = CASES["planner_admission"]
    got = _sim_choices(_simulator(case))
    assert any(c[0].startswith("rejected_slo") for c in got)
    assert any(not c[0].startswith("rejected") for c in got)


def test_a_planner_decision_reads_the_cached_prefix() -> None:
    """The prefix snapshot reaches the decision on both sides (a cached worker wins a tie)."""
    case = CASES["planner_conditional"]
    sim = _simulator(case)
    cached = sim.prefix.match([*SHARED, 1], BLOCK, ["D1", "P1", "D0"])
    assert cached == {"D1": 64, "P1": 32, "D0": 0}
    assert isinstance(sim.planner, slo.SloPlanner)
