"""The thread policy (router/threads.py): stats in, target threads per worker out; and the
router's loop that sends them (router/thread_moves.py) over fake links."""

from __future__ import annotations

import collections
import math
import time
from types import SimpleNamespace

import pytest

from pdserve.costmodel.model import CostModel
from pdserve.router import threads
from pdserve.router.balancer import PoolSample
from pdserve.router.events import RouterEvents
from pdserve.router.loads import Job, WorkerLoad
from pdserve.router.roles import Roles
from pdserve.router.slo import SloPlanner
from pdserve.router.thread_moves import ThreadMover
from pdserve.router.threads import ThreadPolicy, ThreadSample, handover, share
from pdserve.router.worker_stats import WorkerStats

P, D = ("P0",), ("D0",)


def sample(  # type: ignore[no-untyped-def]
    p: float = 0.0, d: float = 0.0, *, p_idle: bool = False, d_idle: bool = False, slack=0.0
):
    return ThreadSample(PoolSample(p, d, len(P), len(D)), P, D, p_idle, d_idle, slack)


def run(policy: ThreadPolicy, s: ThreadSample, t0: float, t1: float, dt: float = 0.1):  # type: ignore[no-untyped-def]
    """Observe `s` every `dt` from t0 to t1; the last targets."""
    out: dict[str, int] = {}
    t = t0
    while t <= t1 + 1e-9:
        out = policy.observe(t, s)
        t += dt
    return out


def test_both_busy_starts_from_an_even_split_and_never_exceeds_the_cores() -> None:
    policy = ThreadPolicy(cores=8)
    targets = policy.observe(0.0, sample(0.5, 0.5))
    assert targets == {"P0": 4, "D0": 4} and policy.state == "split"


def test_p_idle_lends_every_core_to_d_and_work_on_p_takes_them_back_at_once() -> None:
    policy = ThreadPolicy(cores=4, park_after_s=0.5)
    assert policy.observe(0.0, sample(p_idle=True)) == {"P0": 2, "D0": 2}  # not idle long yet
    assert run(policy, sample(p_idle=True), 0.1, 0.6) == {"P0": 1, "D0": 4}
    assert policy.state == "lend_decode"
    assert policy.observe(0.7, sample(0.2, 0.1)) == {"P0": 2, "D0": 2}  # a prompt arrived
    assert policy.state == "split" and policy.moves == 2


def test_d_idle_lends_to_p_and_an_idle_host_waits_with_ps_cores_ready() -> None:
    policy = ThreadPolicy(cores=4, park_after_s=0.0)
    assert policy.observe(0.0, sample(0.5, d_idle=True)) == {"P0": 4, "D0": 1}
    # nothing anywhere: the next request starts with a prefill, which runs on the threads its
    # step starts with, so P holds the cores (after park_after_s, as any lend)
    fresh = ThreadPolicy(cores=4, park_after_s=0.5)
    assert fresh.observe(0.0, sample(p_idle=True, d_idle=True)) == {"P0": 2, "D0": 2}
    assert run(fresh, sample(p_idle=True, d_idle=True), 0.1, 0.6) == {"P0": 4, "D0": 1}
    assert fresh.state == "lend_prefill"
    # the prompt's KV reaches D while P, idle that long, parks: D gets every core at once
    assert fresh.observe(0.7, sample(0.0, 0.1, p_idle=True)) == {"P0": 1, "D0": 4}


def test_p_over_its_ttft_budget_gets_a_core_when_d_has_slack_after_sustain() -> None:
    policy = ThreadPolicy(cores=4, sustain_s=1.0, cooldown_s=2.0)
    assert run(policy, sample(p=0.9, d=0.1), 0.0, 0.9) == {"P0": 2, "D0": 2}
    assert run(policy, sample(p=0.9, d=0.1), 1.0, 1.0) == {"P0": 3, "D0": 1}
    # D keeps at least one thread, however long P stays over
    assert run(policy, sample(p=0.9, d=0.1), 1.1, 30.0) == {"P0": 3, "D0": 1}


def test_p_over_but_d_without_slack_moves_nothing() -> None:
    policy = ThreadPolicy(cores=4, sustain_s=0.0, cooldown_s=0.0)
    assert run(policy, sample(p=2.0, d=0.5), 0.0, 10.0) == {"P0": 2, "D0": 2}
    assert policy.moves == 0


def test_d_losing_its_tpot_slack_gets_cores_back_even_with_p_over() -> None:
    policy = ThreadPolicy(cores=6, sustain_s=0.0, cooldown_s=1.0, p_cores=5)
    targets = run(policy, sample(p=0.9, d=0.9), 0.0, 0.05)
    assert targets == {"P0": 4, "D0": 2}
    assert run(policy, sample(p=0.9, d=0.9), 0.1, 0.9) == {"P0": 4, "D0": 2}  # cooldown
    assert run(policy, sample(p=0.9, d=0.9), 1.0, 1.0) == {"P0": 3, "D0": 3}


def test_pressures_inside_the_band_do_not_flap() -> None:
    policy = ThreadPolicy(cores=4, sustain_s=1.0, cooldown_s=0.0)
    for i in range(100):  # P over, D alternating above low and below: never sustained
        d = 0.1 if i % 2 else 0.5
        policy.observe(i * 0.3, sample(p=0.9, d=d))
    assert policy.moves == 0


def test_several_workers_per_pool_share_the_pool_and_bad_settings_raise() -> None:
    assert share(["a", "b", "c"], 7) == {"a": 3, "b": 2, "c": 2}
    assert share(["a", "b"], 1) == {"a": 1, "b": 1}
    policy = ThreadPolicy(cores=8)
    s = ThreadSample(PoolSample(0.5, 0.5, 2, 2), ("P0", "P1"), ("D0", "D1"), False, False)
    assert policy.observe(0.0, s) == {"P0": 2, "P1": 2, "D0": 2, "D1": 2}
    with pytest.raises(ValueError, match="at least 2 cores"):
        ThreadPolicy(cores=1)
    with pytest.raises(ValueError, match="low < high"):
        ThreadPolicy(cores=2, low=0.8, high=0.7)
    with pytest.raises(ValueError, match="as many cores"):
        ThreadPolicy(cores=2).observe(0.0, s)


def test_handover_frees_cores_before_giving_them() -> None:
    current = {"P0": 2, "D0": 2}
    targets = {"P0": 1, "D0": 3}
    assert handover(current, targets) == {"P0": 1}  # D waits for P's shrink
    assert handover({"P0": 1, "D0": 2}, targets) == {"D0": 3}
    assert handover({"P0": 1, "D0": 3}, targets) == {}
    assert handover({}, {"P0": 2}) == {"P0": 2}  # not reported yet: sent


def test_a_hold_and_the_grow_behind_it_go_together_the_hold_first() -> None:
    # D told 0 frees its cores when its step in progress ends: P need not wait for the ack
    assert list(handover({"P0": 1, "D0": 1}, {"P0": 2, "D0": 0}).items()) == [("D0", 0), ("P0", 2)]
    assert handover({"P0": 1, "D0": 2}, {"P0": 2, "D0": 0}) == {"D0": 0, "P0": 2}
    # a shrink to a count above 0 still frees its cores first
    assert handover({"P0": 2, "D0": 0}, {"P0": 1, "D0": 1}) == {"P0": 1}


# ---- the router's loop (thread_moves.py) over fake links ------------------------------------
class FakeLinks:
    """What the mover reads and sends through: the pools, each worker's stats, sent messages."""

    def __init__(self) -> None:
        self.workers = [worker("P0", "prefill"), worker("D0", "decode")]
        self.sent: list[tuple[str, object]] = []

    def pools(self) -> dict[str, list]:  # type: ignore[type-arg]
        return {r: [w for w in self.workers if w.role == r] for r in ("prefill", "decode")}

    def find(self, worker_id: str):  # type: ignore[no-untyped-def]
        return next(w for w in self.workers if w.worker_id == worker_id)

    def send(self, w, msg) -> None:  # type: ignore[no-untyped-def]
        self.sent.append((w.worker_id, msg))

    def ack(self) -> None:
        """The workers apply what was sent and report it (their Stats reply)."""
        for worker_id, msg in self.sent:
            self.find(worker_id).stats = WorkerStats(threads=msg.threads)  # type: ignore[attr-defined]
        self.sent.clear()


def worker(worker_id: str, role: str) -> SimpleNamespace:
    return SimpleNamespace(
        worker_id=worker_id, role=role, load=WorkerLoad(worker_id), stats=WorkerStats(threads=2)
    )


def test_the_mover_lends_d_the_cores_in_handover_order_and_counts_the_moves() -> None:
    links, events = FakeLinks(), RouterEvents()
    planner = SloPlanner(CostModel((0.0, 1e-3, 0.0), (0.01, 1e-3, 0.0), (0.0, 1e9)))
    policy = ThreadPolicy(cores=4, park_after_s=0.0)
    mover = ThreadMover(links, events, planner, policy)  # type: ignore[arg-type]
    links.find("D0").load.add(Job("r1", 0.0, 100, 50, True, 0.0, first_at=0.0))
    mover.tick(0.0)  # P idle, D decoding: D gets every core
    assert [(w, msg.threads) for w, msg in links.sent] == [("P0", 1)]  # P shrinks first
    links.ack()
    mover.tick(0.1)
    assert [(w, msg.threads) for w, msg in links.sent] == [("D0", 4)]
    links.ack()
    mover.tick(0.2)  # D's acknowledged 4 threads: the planner predicts D's steps faster
    assert links.find("D0").load.slowness == pytest.approx(1 / (1 + 0.8 * 3))
    assert links.find("P0").load.slowness == 1.0 and not links.sent
    links.find("P0").load.add(Job("r2", 0.5, 0, 0, False, 0.2))  # a prompt reaches P
    mover.tick(0.3)
    assert [(w, msg.threads) for w, msg in links.sent] == [("D0", 2)]
    links.ack()
    mover.tick(0.4)
    assert [(w, msg.threads) for w, msg in links.sent] == [("P0", 2)]
    assert events.counters["thread_moves_to_decode"] == 1
    assert events.counters["thread_moves_to_prefill"] == 1
    status = mover.status()
    assert status["state"] == "split" and status["targets"] == {"P0": 2, "D0": 2}
    assert status["decode_slack_s"] == 0.0  # no TPOT SLO: no pause costs nobody


def test_the_movers_status_shows_ds_slack_and_none_while_nothing_decodes() -> None:
    links, events = FakeLinks(), RouterEvents()
    model = CostModel((0.0, 1e-3, 0.0), (0.01, 1e-3, 0.0), (0.0, 1e9))
    planner = SloPlanner(model, slo_tpot_s=0.1)
    mover = ThreadMover(links, events, planner, ThreadPolicy(cores=2))  # type: ignore[arg-type]
    mover.tick(0.0)
    assert mover.status()["decode_slack_s"] is None  # nothing decoding: unbounded
    d = links.find("D0").load
    d.add(Job("r1", 0.0, 100, 49, True, 0.0, first_at=0.0, generated=1))  # 50 tokens at 100 ms
    mover.tick(1.0)
    # priced at the one thread D resumes on after a hold, not the two it is lent now
    slack = threads.decode_slack([d], planner, 1.0, mover.policy.resume_slowness(1, 1))
    assert 0 < slack < 3.9  # 4.9 s of budget less the second run and 49 steps
    assert slack < threads.decode_slack([d], planner, 1.0)
    assert mover.status()["decode_slack_s"] == round(slack, 3)


def test_a_request_waiting_for_ps_kv_leaves_d_idle_so_p_keeps_the_cores() -> None:
    planner = SloPlanner(CostModel((0.0, 1e-3, 0.0), (0.01, 1e-3, 0.0), (0.0, 1e9)))
    p, d = WorkerLoad("P0"), WorkerLoad("D0")
    p.add(Job("r1", 0.9, 0, 0, False, 0.0))  # P prefills r1 ...
    d.add(Job("r1", 0.0, 900, 64, True, 0.0))  # ... D holds its place until the KV comes
    s = threads.sample({"P0": p}, {"D0": d}, planner, 0.1)
    assert not s.prefill_idle and s.decode_idle
    policy = ThreadPolicy(cores=2, park_after_s=0.0)
    assert policy.observe(0.1, s) == {"P0": 2, "D0": 1}
    d.tokens("r1", 1, 1.0)  # D's first decoded token: now it has work, the split comes back
    p.first_token("r1", 1.0)
    s = threads.sample({"P0": p}, {"D0": d}, planner, 1.0)
    assert s.prefill_idle and not s.decode_idle
    local = WorkerLoad("D0")  # a prompt D prefills itself (the local route) is work at once
    local.add(Job("r2", 0.5, 0, 64, True, 1.0))
    assert not threads.sample({"P0": WorkerLoad("P0")}, {"D0": local}, planner, 1.1).decode_idle


def test_a_worker_refuses_a_thread_count_out_of_range_and_holds_its_steps_at_zero() -> None:
    from pdserve.workers.worker import Worker

    scheduler = SimpleNamespace(step_tokens=None)
    fake = SimpleNamespace(
        counters=collections.Counter(), held=False, engine=SimpleNamespace(scheduler=scheduler)
    )
    for bad in (-1, 10**6):
        with pytest.raises(ValueError, match="threads must be in"):
            Worker.set_threads(fake, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step_tokens=-1"):
        Worker.set_threads(fake, 1, -1)  # type: ignore[arg-type]
    Worker.set_threads(fake, 1, 256)  # type: ignore[arg-type]  # short of the cores: small steps
    assert scheduler.step_tokens == 256
    Worker.set_threads(fake, 1, 0)  # type: ignore[arg-type]  # the engine's own budget again
    assert scheduler.step_tokens is None
    import torch

    before = torch.get_num_threads()
    Worker.set_threads(fake, 0)  # type: ignore[arg-type]
    # held: no steps, and the KV it still stores is written on one thread
    assert fake.held and fake.counters["step_holds"] == 1 and torch.get_num_threads() == 1
    Worker.set_threads(fake, 0)  # type: ignore[arg-type]  # a resend: one hold
    assert fake.counters["step_holds"] == 1
    Worker.set_threads(fake, before)  # type: ignore[arg-type]
    assert not fake.held and fake.counters["step_resumes"] == 1
    assert torch.get_num_threads() == before


def test_both_busy_on_two_cores_d_holds_within_its_slack_and_p_takes_every_core() -> None:
    policy = ThreadPolicy(cores=2, hold_reserve_s=1.0)
    # D's requests could pause 1.5 s: not above twice the reserve, the split stays
    assert policy.observe(0.0, sample(0.5, 0.1, slack=1.5)) == {"P0": 1, "D0": 1}
    assert policy.observe(0.1, sample(0.5, 0.1, slack=2.5)) == {"P0": 2, "D0": 0}
    assert policy.state == "hold_decode" and policy.moves == 1
    # held, the slack shrinks: D holds on while it is over the reserve, resumes under it
    assert policy.observe(0.2, sample(0.5, 0.1, slack=1.2)) == {"P0": 2, "D0": 0}
    assert policy.observe(0.3, sample(0.5, 0.1, slack=0.8)) == {"P0": 1, "D0": 1}
    assert policy.state == "split"
    # P's prompts done: D gets every core after park_after_s, whatever its slack
    assert run(policy, sample(0.0, 0.1, p_idle=True, slack=9.0), 0.4, 1.0) == {"P0": 1, "D0": 2}


def test_no_hold_where_the_split_can_still_give_p_a_core_or_d_has_no_slack() -> None:
    wide = ThreadPolicy(cores=8, hold_reserve_s=1.0)  # P at 4 of 8: it grows by one-core moves
    assert wide.observe(0.0, sample(0.5, 0.1, slack=60.0)) == {"P0": 4, "D0": 4}
    narrow = ThreadPolicy(cores=2, hold_reserve_s=1.0)
    assert narrow.observe(0.0, sample(0.9, 0.1, slack=0.5)) == {"P0": 1, "D0": 1}


def test_decode_slack_is_the_tightest_requests_tpot_time_left_over() -> None:
    model = CostModel((0.0, 1e-3, 0.0), (0.01, 0.0, 0.0), (0.0, 1e9))  # 10 ms a decode step
    planner = SloPlanner(model, slo_tpot_s=0.1)
    d = WorkerLoad("D0")
    # 65 tokens, 10 decoded in the 1 s since its first token: 6.4 s of SLO - 1 s - 55 steps
    d.add(Job("r1", 0.0, 910, 55, True, 0.0, first_at=1.0, generated=10))
    assert threads.decode_slack([d], planner, 2.0) == pytest.approx(6.4 - 1.0 - 0.55)
    # P still prefills it: its TPOT has not started (a 4-token answer here kept D from holding
    # for the very prompt it waited for)
    d.add(Job("r2", 0.0, 900, 20, True, 1.5))
    assert threads.decode_slack([d], planner, 2.0) == pytest.approx(6.4 - 1.0 - 0.55)
    # P's first token came 0.1 s ago, its KV on the way: 1.9 s for 20 tokens less 0.1 s, 19 steps
    d.tokens("r2", 1, 1.9)
    assert threads.decode_slack([d], planner, 2.0) == pytest.approx(1.9 - 0.1 - 0.19)
    planner.calibration.tpot = 4.0  # measured TPOTs, holds included: not the step's time
    assert threads.decode_slack([d], planner, 2.0) == pytest.approx(1.9 - 0.1 - 0.19)
    assert threads.decode_slack([WorkerLoad("D0")], planner, 2.0) == float("inf")
    d.add(Job("r3", 0.4, 0, 8, True, 1.9))  # D prefills a prompt itself: its TTFT runs
    assert threads.decode_slack([d], planner, 2.0) == 0.0
    assert threads.decode_slack([WorkerLoad("D0")], SloPlanner(model), 2.0) == 0.0


def test_the_mover_holds_d_as_p_grows_and_counts_it_as_a_move() -> None:
    links, events = FakeLinks(), RouterEvents()
    planner = SloPlanner(CostModel((0.0, 1e-3, 0.0), (0.01, 0.0, 0.0), (0.0, 1e9)), slo_tpot_s=0.1)
    policy = ThreadPolicy(cores=2, park_after_s=0.0)
    for w in links.workers:
        w.stats = WorkerStats(threads=1)
    mover = ThreadMover(links, events, planner, policy)  # type: ignore[arg-type]
    links.find("D0").load.add(Job("r1", 0.0, 100, 60, True, 0.0, first_at=0.0))
    links.find("P0").load.add(Job("r2", 0.5, 0, 0, False, 0.0))
    mover.tick(0.1)  # 5.9 s of SLO for 60 steps of 10 ms, 0.1 s ran: D holds, P grows with it
    assert [(w, msg.threads) for w, msg in links.sent] == [("D0", 0), ("P0", 2)]
    links.ack()
    mover.tick(0.2)
    assert links.sent == []
    assert events.counters["thread_moves_to_prefill"] == 1
    assert links.find("D0").load.slowness == 1.0  # held, not slower: predicted at its split
    assert links.find("D0").load.held_s(1.1) == pytest.approx(1.0)  # the clock runs from 0.1
    links.find("P0").load.first_token("r2", 0.3)  # P done: D gets both cores back
    mover.tick(0.3)
    assert [(w, msg.threads) for w, msg in links.sent] == [("P0", 1)]
    assert links.find("D0").load.held_s(5.0) == pytest.approx(0.2)  # resumed at 0.3
    links.ack()
    mover.tick(0.4)
    assert [(w, msg.threads) for w, msg in links.sent] == [("D0", 2)]
    assert events.counters["thread_moves_to_decode"] == 1


def test_prefills_are_priced_at_the_threads_they_will_run_on_not_those_of_the_moment() -> None:
    policy = ThreadPolicy(cores=4, hold_reserve_s=1.0, p_cores=2)
    wide = policy.prefill_threads(sample(0.0, 0.1, p_idle=True, slack=9.0))
    assert wide == {"P0": 2, "D0": 4}  # P can still grow in `split`: no hold, its share
    narrow = ThreadPolicy(cores=2, hold_reserve_s=1.0)
    # P parked beside a decoding D with slack: once it prefills, D holds and P has both cores;
    # a prompt D prefills itself leaves no slack to hold within: D keeps its split share
    assert narrow.prefill_threads(sample(0.0, 0.1, p_idle=True, slack=9.0)) == {"P0": 2, "D0": 2}
    assert narrow.prefill_threads(sample(0.5, 0.1, slack=9.0)) == {"P0": 2, "D0": 1}
    assert narrow.prefill_threads(sample(0.5, 0.1, slack=1.5)) == {"P0": 1, "D0": 1}
    assert narrow.prefill_threads(sample(0.5, d_idle=True)) == {"P0": 2, "D0": 1}


def test_a_burst_on_a_parked_p_queues_there_instead_of_prefilling_on_d_at_one_thread() -> None:
    """The seeds' case on 2 cores: D decodes with TPOT slack and has every core, P is parked
    at one thread, three 2000-token prompts arrive at once. Priced at the threads of the
    moment, P looked too slow for the second and D, on two threads, fast enough: D took it
    and then prefilled it on one (`threads.price` prices it at those)."""
    model = CostModel((0.0, 1e-3, 0.0), (0.01, 0.0, 0.0), (0.0, 1e9))  # 2 s a prompt, 1 thread
    routes = []

    def burst(priced: bool) -> list[str]:
        planner = SloPlanner(model, slo_ttft_s=3.5, slo_tpot_s=0.1, mode="overflow")
        policy = ThreadPolicy(cores=2, park_after_s=0.0)
        p, d = WorkerLoad("P0"), WorkerLoad("D0", slowness=threads.slowness(2, 1))
        d.add(Job("r0", 0.0, 2100, 250, True, 0.0, first_at=0.0, generated=50))
        routes[:] = planner.routes(["P0"], ["D0"], [])
        chosen = []
        for i in range(3):
            s = threads.sample({"P0": p}, {"D0": d}, planner, 1.0)
            policy.observe(1.0, s)
            if priced:
                threads.price(policy, s, {"P0": p, "D0": d}, planner)
            pick = planner.decide(2000, 300, routes, {"P0": p, "D0": d}, {}, 1.0).chosen
            assert pick is not None
            chosen.append(pick.route.kind)
            first = p if pick.route.kind == "remote" else d
            first.add(
                Job(f"b{i}", planner.prefill_time(2000, 0, first), 2000, 300, first is d, 1.0)
            )
        return chosen

    assert burst(priced=False)[:2] == ["remote", "local"]
    assert burst(priced=True) == ["remote", "remote", "remote"]


def test_price_tells_the_planner_how_much_a_local_prefill_slows_ps_queue() -> None:
    planner = SloPlanner(CostModel((0.0, 1e-3, 0.0), (0.01, 0.0, 0.0), (0.0, 1e9)))
    policy = ThreadPolicy(cores=2, hold_reserve_s=1.0)
    p, d = WorkerLoad("P0"), WorkerLoad("D0")
    threads.price(policy, sample(0.5, 0.1, slack=9.0), {"P0": p, "D0": d}, planner)
    assert p.prefill_rate() == pytest.approx(threads.slowness(2, 1)) and d.prefill_rate() == 1.0
    assert planner.coupled == {"P0": pytest.approx(1.8)}  # speedup(2) / speedup(1)
    threads.price(policy, sample(0.5, 0.1, slack=0.5), {"P0": p, "D0": d}, planner)
    assert p.prefill_rate() == 1.0 and planner.coupled == {}  # no hold to lose
    # D lent both cores decodes a new request on its one-thread share while P is busy: P's
    # busy share starts at 1 (no samples yet)
    d.slowness = threads.slowness(2, 1)
    threads.price(policy, sample(0.5, 0.1, slack=0.5), {"P0": p, "D0": d}, planner)
    assert d.decode_factor() == 1.0
    # P seen idle for a time constant: 1/e of the time busy, both cores the rest
    policy.observe(0.0, sample(0.0, 0.1, p_idle=True))
    policy.observe(threads.BUSY_TAU_S, sample(0.0, 0.1, p_idle=True))
    busy = math.exp(-1.0)
    assert policy.prefill_busy == pytest.approx(busy)
    threads.price(policy, sample(0.0, 0.1, p_idle=True), {"P0": p, "D0": d}, planner)
    assert d.decode_factor() == pytest.approx(busy + (1 - busy) * threads.slowness(2, 1))
    # busy again for as long: the share climbs back
    policy.observe(2 * threads.BUSY_TAU_S, sample(0.5, 0.1))
    assert policy.prefill_busy == pytest.approx(busy + (1 - math.exp(-1.0)) * (1 - busy))


def test_a_dispatch_and_an_acknowledged_count_sample_the_split_at_once() -> None:
    links, events = FakeLinks(), RouterEvents()
    planner = SloPlanner(CostModel((0.0, 1e-3, 0.0), (0.01, 0.0, 0.0), (0.0, 1e9)), slo_tpot_s=0.1)
    policy = ThreadPolicy(cores=2, park_after_s=0.0)
    roles = Roles(
        links,  # type: ignore[arg-type]
        events,
        lambda w: False,
        planner=planner,
        autobalancer=None,
        interval_s=1.0,
        drain_timeout_s=1.0,
        switch_timeout_s=1.0,
        thread_policy=policy,
    )
    for w in links.workers:  # the split: one thread each
        w.stats = WorkerStats(threads=1)
    links.find("D0").load.add(Job("r1", 0.0, 100, 60, True, 0.0, first_at=time.monotonic()))
    roles.acknowledged(1, 1)  # the same count: nothing to sample
    assert links.sent == []
    links.find("P0").load.add(Job("r2", 0.5, 0, 0, False, time.monotonic()))
    roles.dispatched()  # the prompt's SetThreads go out before the prompt itself
    assert [(w, msg.threads) for w, msg in links.sent] == [("D0", 0), ("P0", 2)]
    links.ack()
    links.find("P0").load.first_token("r2", time.monotonic())  # P done: D takes its cores back
    roles.dispatched()
    assert [(w, msg.threads) for w, msg in links.sent] == [("P0", 1)]  # P frees them first
    links.find("P0").stats = WorkerStats(threads=1)  # P's Stats reply, acknowledged
    links.sent.clear()
    roles.acknowledged(2, 1)
    assert [(w, msg.threads) for w, msg in links.sent] == [("D0", 2)]  # not at the next tick


def test_a_worker_short_of_the_cores_takes_small_steps_and_one_with_them_all_its_budget() -> None:
    policy = ThreadPolicy(cores=2, grain_tokens=256)
    assert policy.step_tokens({"P0": 1, "D0": 1}) == {"P0": 256, "D0": 256}
    assert policy.step_tokens({"P0": 2, "D0": 0}) == {"P0": 0, "D0": 256}  # a hold: P's budget
    with pytest.raises(ValueError, match="grain_tokens"):
        ThreadPolicy(cores=2, grain_tokens=0)


def test_a_hold_must_outlast_ps_longest_prompt_which_may_run_as_one_step() -> None:
    def busy(slack: float, step: float) -> ThreadSample:
        return ThreadSample(PoolSample(0.5, 0.1, 1, 1), P, D, False, False, slack, step)

    policy = ThreadPolicy(cores=2, hold_reserve_s=1.0, profiled_threads=2)
    assert policy.observe(0.0, busy(5.0, 0.0)) == {"P0": 2, "D0": 0}  # 5 s > twice the reserve
    policy = ThreadPolicy(cores=2, hold_reserve_s=1.0, profiled_threads=2)
    # a 3.5 s prompt P may take in one step: 5 s of slack does not cover it and the reserve
    assert policy.observe(0.0, busy(5.0, 3.5)) == {"P0": 1, "D0": 1}
    assert policy.prefill_threads(busy(5.0, 3.5)) == {"P0": 1, "D0": 1}
    assert policy.observe(0.1, busy(6.0, 3.5)) == {"P0": 2, "D0": 0}
    # held, the reserve is single: it lasts while the slack covers the step and one reserve
    assert policy.observe(0.2, busy(4.6, 3.5)) == {"P0": 2, "D0": 0}
    assert policy.observe(0.3, busy(4.4, 3.5)) == {"P0": 1, "D0": 1}
    # the step is priced at every core, not at P's threads of the moment (which hang on the
    # hold): profiled at one thread, 3.5 s is 1.94 s on two, and 4.4 s of slack covers it twice
    one = ThreadPolicy(cores=2, hold_reserve_s=1.0, profiled_threads=1)
    assert one.observe(0.0, busy(4.4, 3.5)) == {"P0": 2, "D0": 0}


def test_the_sample_carries_ps_longest_prompt_step_owed() -> None:
    from pdserve.router import decide

    model = CostModel((0.0, 1e-3, 0.0), (0.01, 0.0, 0.0), (0.0, 1e9))  # 1 ms a prompt token
    planner = SloPlanner(model, token_budget=2048)
    p, d = WorkerLoad("P0"), WorkerLoad("D0")
    decide.book(planner, "r1", (p, d), 800, 16, 0.0, None)
    decide.book(planner, "r2", (p, d), 3000, 16, 0.0, None)  # two steps: the first is 2048
    assert p.jobs["r2"].step_s == pytest.approx(2.048)
    s = threads.sample({"P0": p}, {"D0": d}, planner, 0.1)
    assert s.prefill_step_s == pytest.approx(2.048)
    p.first_token("r2", 0.2)  # its first token came: nothing more owed
    assert threads.sample({"P0": p}, {"D0": d}, planner, 0.3).prefill_step_s == pytest.approx(0.8)


def test_the_mover_sends_each_count_with_its_step_cap() -> None:
    links, events = FakeLinks(), RouterEvents()
    planner = SloPlanner(CostModel((0.0, 1e-3, 0.0), (0.01, 0.0, 0.0), (0.0, 1e9)), slo_tpot_s=0.1)
    policy = ThreadPolicy(cores=2, park_after_s=10.0, grain_tokens=128)
    for w in links.workers:
        w.stats = WorkerStats(threads=1)
    mover = ThreadMover(links, events, planner, policy)  # type: ignore[arg-type]
    mover.tick(0.0)  # the split at start-up: no count changes, the caps go on their own
    assert [(w, msg.threads, msg.step_tokens) for w, msg in links.sent] == [
        ("P0", 1, 128),
        ("D0", 1, 128),
    ]
    links.ack()
    mover.tick(0.1)
    assert links.sent == []  # sent once, not every sample
    links.find("D0").load.add(Job("r1", 0.0, 100, 60, True, 0.0, first_at=0.0))
    links.find("P0").load.add(Job("r2", 0.5, 0, 0, False, 0.1))
    mover.tick(0.2)  # D holds: P takes every core and its whole budget with them
    assert [(w, msg.threads, msg.step_tokens) for w, msg in links.sent] == [
        ("D0", 0, 128),
        ("P0", 2, 0),
    ]
    links.ack()
    links.find("P0").load.first_token("r2", 0.3)
    mover.tick(0.3)  # P gives the core back and takes small steps again
    assert [(w, msg.threads, msg.step_tokens) for w, msg in links.sent] == [("P0", 1, 128)]


def test_ds_slack_prices_its_steps_at_the_threads_it_resumes_on_after_a_hold() -> None:
    model = CostModel((0.0, 1e-3, 0.0), (0.01, 0.0, 0.0), (0.0, 1e9))  # 10 ms a decode step
    planner = SloPlanner(model, slo_tpot_s=0.1)
    d = WorkerLoad("D0")
    d.add(Job("r1", 0.0, 910, 55, True, 0.0, first_at=1.0, generated=10))
    d.slowness = 0.5  # lent every core while P was idle: its steps run twice as fast now
    assert threads.decode_slack([d], planner, 2.0) == pytest.approx(6.4 - 1.0 - 0.275)
    # a hold ends in `split`, on one of the two cores: the 55 steps left at the profile's time
    policy = ThreadPolicy(cores=2)
    resume = policy.resume_slowness(len(P), len(D))
    assert resume == pytest.approx(1.0)
    assert threads.decode_slack([d], planner, 2.0, resume) == pytest.approx(6.4 - 1.0 - 0.55)
    d.slowness = 2.0  # slower now than after the hold: the slower one counts
    assert threads.decode_slack([d], planner, 2.0, resume) == pytest.approx(6.4 - 1.0 - 1.1)
    # with four cores split 2 + 2, D resumes on two threads of a one-thread profile
    assert ThreadPolicy(cores=4).resume_slowness(1, 1) == pytest.approx(threads.slowness(2, 1))


def test_ds_slack_keeps_room_for_the_requests_that_join_it_meanwhile() -> None:
    model = CostModel((0.0, 1e-3, 0.0), (0.01, 0.002, 0.0), (0.0, 1e9))  # +2 ms a request
    planner = SloPlanner(model, slo_tpot_s=0.1)
    d = WorkerLoad("D0")
    d.add(Job("r1", 0.0, 910, 55, True, 0.0, first_at=1.0, generated=10))
    quiet = threads.decode_slack([d], planner, 2.0)
    assert quiet == pytest.approx(6.4 - 1.0 - 55 * 0.012)
    for t in (0.0, 0.5, 1.0):  # 2 requests a second reach the one D (the last arrivals' rate)
        planner.arrivals.add(t)
    left = 55 * 0.012  # 0.66 s of steps: 0.66 joiners on average over them, 2 ms a step each
    joined = 6.4 - 1.0 - left - 55 * (2 * left / 2) * 0.002
    assert threads.decode_slack([d], planner, 2.0) == pytest.approx(joined)
    assert joined < quiet
