"""The SLO planner (pure): predictions, admission, conditional disaggregation, prefix weighing,
calibration; and the autobalancer's hysteresis. Loads are scripted, times are given."""

from __future__ import annotations

import pytest

from pdserve.costmodel.model import CostModel
from pdserve.router.balancer import Autobalancer, PoolSample
from pdserve.router.loads import Job, WorkerLoad
from pdserve.router.slo import Calibration, Route, SloPlanner

# 1 ms per prompt token (+ attention), a 20 ms decode step + 2 ms per request in the batch
MODEL = CostModel((0.01, 1e-3, 1e-4), (0.02, 0.002, 0.001), (0.001, 1e9))


def planner(**kw) -> SloPlanner:  # type: ignore[no-untyped-def]
    return SloPlanner(MODEL, kv_bytes_per_token=1000, **kw)


def loads(*ids: str) -> dict[str, WorkerLoad]:
    return {i: WorkerLoad(i) for i in ids}


def decoding(
    load: WorkerLoad, n: int, now: float = 0.0, context: int = 500, remaining: int = 200
) -> None:
    for i in range(n):
        load.add(Job(f"run{i}", 0.0, context, remaining, True, now, first_at=now, generated=1))


def test_prediction_adds_the_queue_ahead_and_the_prompt() -> None:
    p = planner()
    ls = loads("P0", "D0")
    ls["P0"].add(Job("a", 2.0, 0, 0, False, queued_at=10.0))
    pred = p.predict(1000, 100, Route("remote", "P0", "D0"), ls, {}, now=10.5)
    assert pred.ttft_s == pytest.approx(1.5 + MODEL.prefill_s(1000))
    step = MODEL.decode_step_s(1, 1000 + 50)
    assert pred.tpot_s == pytest.approx(step + (MODEL.transfer_s(1000 * 1000) + 0.002) / 99)


def test_prediction_uses_the_per_batch_decode_terms_and_the_receive_term() -> None:
    from dataclasses import replace

    # a lone decode step 20 ms, two rows 60 ms (the CPU kernel jump), 1 ms per 1k context;
    # D registers a hand-off at 5 ms + 10 us per token
    model = replace(
        MODEL, decode_by_batch=((1, 0.02), (2, 0.06)), decode_context=0.001, receive=(0.005, 1e-5)
    )
    p = SloPlanner(model, kv_bytes_per_token=1000)
    ls = loads("P0", "D0")
    decoding(ls["D0"], 1, context=500)  # one running request: ours makes a batch of 2
    pred = p.predict(1000, 100, Route("remote", "P0", "D0"), ls, {}, now=0.0)
    step = 0.06 + 0.001 * (500 + 1050) / 1000
    handoff = MODEL.transfer_s(1000 * 1000) + 0.005 + 1e-5 * 1000 + 0.002
    assert pred.tpot_s == pytest.approx(step + handoff / 99)
    # the running request: one more row (+ 40 ms a step) for the 100 steps it shares with
    # ours, and the receive stalls it once
    assert pred.cost_s - (pred.ttft_s + 100 * pred.tpot_s) == pytest.approx(
        0.015 + 100 * (step - (0.02 + 0.0005))
    )


def test_a_remote_request_decodes_beside_only_the_jobs_still_running_when_its_kv_arrives() -> None:
    from dataclasses import replace

    # a lone decode step 20 ms, three rows 60 ms; no context term
    model = replace(MODEL, decode_by_batch=((1, 0.02), (3, 0.06)), decode_context=0.0)
    p = SloPlanner(model, kv_bytes_per_token=1000, slo_tpot_s=0.05)
    ls = loads("P0", "D0")
    decoding(ls["D0"], 2, remaining=40)  # done before P has prefilled 2000 tokens
    route = Route("remote", "P0", "D0")
    pred = p.predict(2000, 200, route, ls, {}, now=0.0)
    handoff = MODEL.transfer_s(2000 * 1000) + 0.002
    assert pred.ttft_s > 40 * 0.04  # their 40 steps at a batch of 2
    assert pred.tpot_s == pytest.approx(0.02 + handoff / 199)  # alone: within the SLO
    assert p.decide(2000, 200, [route], ls, {}, now=0.0).chosen is not None
    # the same jobs with their whole answers ahead share every step: a batch of 3, refused
    decoding(ls["D0"], 2, remaining=5000)
    pred = p.predict(2000, 200, route, ls, {}, now=0.0)
    assert pred.tpot_s == pytest.approx(0.06 + handoff / 199)
    assert pred.miss == "slo_tpot"


def test_jobs_not_yet_decoding_start_when_their_prefill_ends_and_finishing_ones_count_in_part() -> (
    None
):
    from dataclasses import replace

    model = replace(MODEL, decode_by_batch=((1, 0.02), (2, 0.04)), decode_context=0.0)
    p = SloPlanner(model, kv_bytes_per_token=1000)
    # "queued" still prefills on P, 1 s ahead of the new request's own prefill there: its 300
    # tokens outlast the new request's answer, so it shares every step of it
    ls = loads("P0", "D0")
    ls["P0"].add(Job("queued", 1.0, 0, 0, False, 0.0))
    ls["D0"].add(Job("queued", 0.0, 500, 300, True, 0.0))
    route = Route("remote", "P0", "D0")
    assert p.predict(100, 101, route, ls, {}, now=0.0).tpot_s == pytest.approx(
        0.04 + (model.transfer_s(100 * 1000) + 0.002) / 100
    )
    # with 3 tokens to go it ends before the new request's KV arrives: shares none
    ls["D0"].jobs["queued"].remaining = 3
    assert p.predict(100, 101, route, ls, {}, now=0.0).tpot_s == pytest.approx(
        0.02 + (model.transfer_s(100 * 1000) + 0.002) / 100
    )
    ls = loads("P0", "D0")
    # 75 steps left at 20 ms a step: 1.5 s; ours starts decoding after its prefill
    decoding(ls["D0"], 1, remaining=75)
    pred = p.predict(100, 101, Route("local", "D0"), ls, {}, now=0.0)
    shared = (1.5 - pred.ttft_s) / 0.02  # its 101 steps start at its first token
    assert 0 < shared < 75
    assert pred.tpot_s == pytest.approx((shared * 0.04 + (101 - shared) * 0.02) / 101)


def test_idle_short_prompt_runs_locally_and_a_busy_decoder_sends_long_ones_to_p() -> None:
    p = planner()
    ls = loads("P0", "D0")
    routes = p.routes(["P0"], ["D0"], [])
    assert {r.kind for r in routes} == {"remote", "local"}
    idle = p.decide(100, 50, routes, ls, {}, now=0.0)
    assert idle.chosen is not None and idle.chosen.route.kind == "local"  # no transfer to pay
    decoding(ls["D0"], 8)
    busy = p.decide(2000, 50, routes, ls, {}, now=0.0)
    # 2000 tokens of prefill on D would stall 8 running decodes: P takes it
    assert busy.chosen is not None and busy.chosen.route.kind == "remote"


def test_always_mode_never_prefills_on_d_while_both_pools_exist() -> None:
    p = planner(mode="always")
    assert {r.kind for r in p.routes(["P0"], ["D0"], [])} == {"remote"}
    assert {r.kind for r in p.routes([], ["D0"], [])} == {"local"}  # P pool gone: D runs it
    with pytest.raises(ValueError, match="disaggregation"):
        planner(mode="sometimes")


def test_overflow_mode_prefills_on_d_only_when_p_would_break_ttft() -> None:
    p = planner(mode="overflow", slo_ttft_s=1.0, slo_tpot_s=0.5, admission=False)
    ls = loads("P0", "D0")
    routes = p.routes(["P0"], ["D0"], [])
    assert {r.kind for r in routes} == {"remote", "local"}
    idle = p.decide(100, 50, routes, ls, {}, now=0.0)
    assert idle.chosen is not None and idle.chosen.route.kind == "remote"  # local is cheaper
    # 1.2 s of prompts queued on P: a remote route breaks TTFT, D has the slack to prefill
    ls["P0"].add(Job("queued", 1.2, 0, 0, False, 0.0))
    burst = p.decide(100, 50, routes, ls, {}, now=0.0)
    assert burst.chosen is not None and burst.chosen.route.kind == "local"


def test_a_worker_on_other_threads_than_the_profile_is_predicted_at_its_own_speed() -> None:
    p = planner()
    ls = loads("P0", "D0")
    decoding(ls["D0"], 4)
    base = p.predict(500, 50, Route("local", "D0"), ls, {}, now=0.0)
    ls["D0"].slowness = 0.5  # twice the profile's speed (more threads)
    fast = p.predict(500, 50, Route("local", "D0"), ls, {}, now=0.0)
    assert fast.ttft_s == pytest.approx(base.ttft_s / 2)
    assert fast.tpot_s == pytest.approx(base.tpot_s / 2)


def test_admission_rejects_predicted_ttft_misses_with_a_retry_after() -> None:
    p = planner(slo_ttft_s=1.0, slo_tpot_s=0.2)
    ls = loads("P0", "D0")
    ls["P0"].add(Job("a", 3.0, 0, 0, False, queued_at=0.0))
    ls["D0"].add(Job("b", 3.0, 600, 50, True, queued_at=0.0))
    d = p.decide(500, 50, p.routes(["P0"], ["D0"], []), ls, {}, now=0.0)
    assert d.chosen is None and d.reject == "slo_ttft" and d.retry_after_s >= 2
    # the same request is admitted (best effort) when asked not to reject, e.g. a recovery
    forced = p.decide(500, 50, p.routes(["P0"], ["D0"], []), ls, {}, now=0.0, admit_all=True)
    assert forced.chosen is not None


def test_admission_rejects_tpot_misses_and_protects_running_requests() -> None:
    p = planner(slo_ttft_s=10.0, slo_tpot_s=0.05)
    ls = loads("D0")
    decoding(ls["D0"], 20)  # a step of 20 ms + 42 ms (batch) + 10 ms (context): over 50 ms
    d = p.decide(100, 50, [Route("local", "D0")], ls, {}, now=0.0)
    assert d.chosen is None and d.reject == "slo_tpot"
    # running requests just inside their SLO; a long local prefill would stall them past it
    p2 = planner(slo_ttft_s=10.0, slo_tpot_s=0.1)
    ls2 = loads("D0")
    decoding(ls2["D0"], 2, context=100, remaining=10)  # 3.5 s of stall over 10 tokens
    pred = p2.predict(3000, 2, Route("local", "D0"), ls2, {}, now=0.0)
    assert pred.miss == "slo_tpot_running" and pred.running_worst_s > 0.1


def test_a_cached_prefix_wins_unless_its_holder_is_far_busier() -> None:
    p = planner()
    ls = loads("P0", "P1", "D0")
    routes = [Route("remote", "P0", "D0"), Route("remote", "P1", "D0")]
    cached = {"P0": 1600}
    d = p.decide(2000, 20, routes, ls, cached, now=0.0)
    assert d.chosen is not None and d.chosen.route.first == "P0" and d.chosen.cached_first == 1600
    ls["P0"].add(Job("q", 5.0, 0, 0, False, queued_at=0.0))  # 5 s of queued prefill on P0
    d = p.decide(2000, 20, routes, ls, cached, now=0.0)
    assert d.chosen is not None and d.chosen.route.first == "P1"


def test_cached_tokens_never_reach_the_whole_prompt() -> None:
    p = planner()
    pred = p.predict(64, 4, Route("local", "D0"), loads("D0"), {"D0": 64}, now=0.0)
    assert pred.cached_first == 63  # the last token is always computed


def test_load_bookkeeping_follows_first_tokens_and_deliveries() -> None:
    w = WorkerLoad("D0")
    w.add(Job("a", 1.0, 100, 10, True, queued_at=0.0))
    w.add(Job("b", 0.5, 100, 10, True, queued_at=0.0))
    assert w.prefill_backlog(0.2) == pytest.approx(1.3)
    w.first_token("a", 1.0)
    assert w.prefill_backlog(1.0) == pytest.approx(0.5)
    w.tokens("a", 3, 1.1)
    job = w.jobs["a"]
    assert (job.generated, job.context, job.remaining) == (3, 103, 7)
    w.remove("a")
    w.remove("b")
    assert w.jobs == {} and w.prefill_backlog(2.0) == 0.0


def test_calibration_moves_predictions_toward_what_was_measured() -> None:
    p = planner()
    base = p.predict(1000, 10, Route("local", "D0"), loads("D0"), {}, now=0.0).ttft_s
    for _ in range(30):
        p.calibration.observe("ttft", base, 2 * base)
    again = p.predict(1000, 10, Route("local", "D0"), loads("D0"), {}, now=0.0).ttft_s
    assert again == pytest.approx(2 * base, rel=0.05)
    c = Calibration()
    c.observe("tpot", 1.0, 100.0)  # one wild sample is clamped
    assert c.tpot <= 1 + c.alpha * 3


def test_bad_slos_are_value_errors() -> None:
    with pytest.raises(ValueError, match="slo_ttft"):
        planner(slo_ttft_s=0.0)


# ---- the autobalancer -------------------------------------------------------------------------
def test_autobalancer_moves_only_after_sustained_imbalance_then_cools_down() -> None:
    b = Autobalancer(high=0.7, low=0.3, sustain_s=3.0, cooldown_s=10.0)
    hot_p = PoolSample(prefill_pressure=2.0, decode_pressure=0.1, n_prefill=1, n_decode=2)
    assert b.observe(0.0, hot_p) is None
    assert b.observe(2.0, hot_p) is None
    assert b.observe(3.5, hot_p) == "to_prefill"
    assert b.observe(5.0, hot_p) is None  # cooling down
    assert b.observe(14.0, hot_p) == "to_prefill"


def test_autobalancer_resets_when_the_imbalance_flickers() -> None:
    b = Autobalancer(sustain_s=3.0, cooldown_s=0.0)
    hot_d = PoolSample(0.1, 2.0, 2, 1)
    calm = PoolSample(0.5, 0.5, 2, 1)
    assert b.observe(0.0, hot_d) is None
    assert b.observe(2.0, calm) is None
    assert b.observe(4.0, hot_d) is None  # the clock restarted at 4.0
    assert b.observe(7.5, hot_d) == "to_decode"


def test_autobalancer_keeps_min_pool_and_ignores_single_workers() -> None:
    b = Autobalancer(sustain_s=0.0, cooldown_s=0.0, min_pool=1)
    assert b.observe(0.0, PoolSample(2.0, 0.0, 1, 1)) is None  # would empty the decode pool
    assert b.observe(1.0, PoolSample(2.0, 0.0, 1, 2)) == "to_prefill"
    assert Autobalancer(sustain_s=0.0).observe(0.0, PoolSample(2.0, 0.0, 1, 0)) is None
    with pytest.raises(ValueError):
        Autobalancer(high=0.2, low=0.5)


def test_when_no_route_meets_the_slos_the_one_breaking_fewest_wins() -> None:
    # P is far behind (TTFT will miss either way); prefilling locally would also push the
    # requests running on D past their TPOT SLO: the remote route breaks one SLO, local four
    p = planner(slo_ttft_s=1.0, slo_tpot_s=0.1, admission=False)
    ls = loads("P0", "D0")
    ls["P0"].add(Job("q", 20.0, 0, 0, False, queued_at=0.0))
    ls["D0"].add(Job("q2", 1.5, 0, 50, True, queued_at=0.0))
    decoding(ls["D0"], 3, context=100, remaining=10)
    routes = p.routes(["P0"], ["D0"], [])
    local = p.predict(2000, 20, Route("local", "D0"), ls, {}, now=0.0)
    remote = p.predict(2000, 20, Route("remote", "P0", "D0"), ls, {}, now=0.0)
    assert local.misses > remote.misses >= 1
    d = p.decide(2000, 20, routes, ls, {}, now=0.0)
    assert d.chosen is not None and d.chosen.route.kind == "remote"


def test_oldest_wait_shows_a_queue_the_model_thinks_is_done() -> None:
    w = WorkerLoad("P0")
    w.add(Job("a", 0.1, 0, 0, False, queued_at=0.0))
    w.add(Job("b", 0.1, 0, 0, False, queued_at=0.5))
    assert w.prefill_backlog(3.0) == pytest.approx(0.1)  # the model says: nearly done
    assert w.oldest_wait(3.0) == pytest.approx(3.0)  # yet "a" has waited 3 s
    w.first_token("a", 3.0)
    assert w.oldest_wait(3.0) == pytest.approx(2.5)


def test_pressures_ignore_a_lone_slow_decode_and_see_a_stuck_queue() -> None:
    from pdserve.router.balancer import pressures

    p = planner(slo_ttft_s=1.0, slo_tpot_s=0.05)
    lone, shared, queue = WorkerLoad("D0"), WorkerLoad("D1"), WorkerLoad("P0")
    decoding(lone, 1, context=20000)  # slow alone (> the SLO), yet more D's would not help
    decoding(shared, 4, context=100)
    queue.add(Job("q", 0.01, 0, 0, False, queued_at=0.0))
    assert pressures([queue], [lone], p, 3.0, 1, 1).decode_pressure == 0.0
    sample = pressures([queue], [shared], p, 3.0, 1, 1)
    assert sample.decode_pressure > 0 and sample.prefill_pressure == pytest.approx(3.0)


def test_n_choices_count_as_n_decode_streams() -> None:
    p = planner()
    ls = loads("P0", "D0")
    route = Route("remote", "P0", "D0")
    pred = p.predict(1000, 100, route, ls, {}, now=0.0, streams=4)
    assert pred.tpot_s == pytest.approx(
        MODEL.decode_step_s(4, 4 * (1000 + 50)) + (MODEL.transfer_s(1000 * 1000) + 0.002) / 99
    )
    assert pred.tpot_s > p.predict(1000, 100, route, ls, {}, now=0.0).tpot_s
    ls["D0"].add(Job("n4", 0.0, 500, 100, True, 0.0, streams=4))
    decoding(ls["D0"], 1)
    assert ls["D0"].decode_streams() == 5 and ls["D0"].context_sum() == 4 * 500 + 500


def test_prefills_queued_ahead_stall_a_request_only_where_it_decodes_beside_them() -> None:
    p = planner()
    # a colocated worker prefilling a 2000-token prompt (2 s owed): the next request's own
    # prefill comes after it, so that prefill never runs beside the next request's decode
    ls = loads("C0")
    ls["C0"].add(Job("a", 2.0, 0, 300, True, queued_at=0.0))
    pred = p.predict(1000, 100, Route("colocated", "C0"), ls, {}, now=0.0)
    assert pred.ttft_s == pytest.approx(2.0 + p.prefill_time(1000, 0, ls["C0"]))
    assert pred.tpot_s == pytest.approx(MODEL.decode_step_s(2, 1050))  # "a" decodes beside it
    # remote: D's local prefill (3 s) outlasts this request's TTFT on P (~1.01 s): the rest
    # stalls its first steps, spread over its answer; "b" decodes beside it only from 3 s on
    ls = loads("P0", "D0")
    ls["D0"].add(Job("b", 3.0, 0, 300, True, queued_at=0.0))
    pred = p.predict(1000, 100, Route("remote", "P0", "D0"), ls, {}, now=0.0)
    start, step = MODEL.prefill_s(1000), MODEL.decode_step_s(1, 0)
    shared = (start + 100 * step - 3.0) / step
    assert 0 < shared < 100
    mean = shared * MODEL.decode_step_s(2, 1050) + (100 - shared) * MODEL.decode_step_s(1, 1050)
    handoff = MODEL.transfer_s(1000 * 1000) + 0.002
    assert pred.tpot_s == pytest.approx(mean / 100 + (3.0 - start + handoff) / 99)


def test_a_request_prefilling_ahead_is_protected_from_the_next_prefill() -> None:
    # "a" will decode (300 tokens at ~22 ms) while the next 2000-token prompt prefills beside
    # it (2 s): ~33 ms a token against a 28 ms SLO
    p = planner(slo_ttft_s=10.0, slo_tpot_s=0.028)
    ls = loads("C0")
    ls["C0"].add(Job("a", 0.5, 500, 300, True, queued_at=0.0))
    d = p.decide(2000, 100, [Route("colocated", "C0")], ls, {}, now=0.0)
    assert d.chosen is None and d.reject == "slo_tpot_running"
    # a short prompt stalls it far less: admitted
    assert p.decide(50, 100, [Route("colocated", "C0")], ls, {}, now=0.0).chosen is not None


def test_with_requests_arriving_long_prompts_go_to_an_idle_p_and_short_ones_stay_local() -> None:
    p = planner()
    routes = p.routes(["P0"], ["D0"], [])
    ls = loads("P0", "D0")
    # no arrival history: a lone long prompt is local (no hand-off), as before
    first = p.decide(2000, 100, routes, ls, {}, now=0.0)
    assert first.chosen is not None and first.chosen.route.kind == "local"
    for t in (10.0, 20.0, 30.0):  # one request every 10 s
        p.decide(10, 1, routes, loads("P0", "D0"), {}, now=t)
    assert p.arrival_rate() == pytest.approx(0.1)
    # 2 s of prefill on D would stall the decodes arriving meanwhile (0.1/s x 2 s x 1 s on
    # average): more than the hand-off costs, so the idle P takes it
    long = p.decide(2000, 100, routes, ls, {}, now=40.0)
    assert long.chosen is not None and long.chosen.route.kind == "remote"
    short = p.decide(20, 100, routes, ls, {}, now=41.0)
    assert short.chosen is not None and short.chosen.route.kind == "local"
    # retries are not arrivals
    p.decide(20, 100, routes, ls, {}, now=41.5, admit_all=True)
    assert p.arrivals.rate_over(41.6, 100.0) == pytest.approx(6 / 100)


def test_a_short_requests_tpot_does_not_calibrate_the_model() -> None:
    p = planner()
    # a 4-token request: its TPOT is the first steps' one-off costs (measured 3.5x the model)
    p.learn((1.0, 0.010), ttft=1.0, tpot=0.035, tokens=4)
    assert p.calibration.tpot == 1.0 and p.calibration.samples == 1  # its TTFT still counts
    p.learn((1.0, 0.010), ttft=1.0, tpot=0.020, tokens=300)
    assert p.calibration.tpot == pytest.approx(1.2)


def test_tpot_counts_accepted_tokens_per_step_and_the_verify_rows() -> None:
    """A speculating D: each step verifies 2 draft rows and yields 1 + 1.5 tokens a stream
    (learned from its stats), so the predicted TPOT is (step + verify) / 2.5."""
    from pdserve.router.worker_stats import WorkerStats

    p = planner()
    ls = loads("P0", "D0")
    route = Route("local", "D0")
    plain = p.predict(1000, 100, route, ls, {}, now=0.0).tpot_s
    stats = WorkerStats(decode_tokens=100, spec_draft_tokens=200, spec_accepted_tokens=150)
    assert stats.spec_per_step() == (0.0, 0.0)  # no verify step yet
    stats = WorkerStats(
        decode_tokens=100, spec_draft_tokens=200, spec_accepted_tokens=150, spec_steps=90
    )
    ls["D0"].spec = stats.spec_per_step()
    assert ls["D0"].spec == (2.0, 1.5)
    spec = p.predict(1000, 100, route, ls, {}, now=0.0).tpot_s
    verify = MODEL.prefill_s(2, 1050) - MODEL.prefill_s(0, 0)
    assert spec == pytest.approx((plain + verify) / 2.5)


def test_an_uncalibrated_planner_admits_one_probe_at_a_time_before_refusing() -> None:
    """With calibration_probes (--adaptive), a request predicted to miss is admitted while the
    planner has learned from too few finished requests, one at a time, and marked as a probe;
    once it has learned enough it refuses again."""
    p = planner(slo_ttft_s=1.0, slo_tpot_s=0.2)
    p.calibration_probes = 2
    ls = loads("P0", "D0")
    ls["P0"].add(Job("a", 3.0, 0, 0, False, queued_at=0.0))
    ls["D0"].add(Job("b", 3.0, 600, 50, True, queued_at=0.0))
    routes = p.routes(["P0"], ["D0"], [])
    first = p.decide(500, 50, routes, ls, {}, now=0.0)
    assert first.chosen is not None and first.probe
    second = p.decide(500, 50, routes, ls, {}, now=0.0)  # the probe is still in flight
    assert second.chosen is None and second.reject == "slo_ttft" and not second.probe
    p.learn(p.uncalibrated(first.chosen), ttft=first.chosen.ttft_s, tpot=0.01, tokens=50)
    assert p.decide(500, 50, routes, ls, {}, now=0.0).probe  # learned from 1 of 2
    p.learn(p.uncalibrated(first.chosen), ttft=first.chosen.ttft_s, tpot=0.01, tokens=50)
    assert p.decide(500, 50, routes, ls, {}, now=0.0).chosen is None  # calibrated: refuses


def test_a_local_prefill_that_would_slow_ps_queue_past_ttft_is_a_miss_where_cores_are_shared() -> (
    None
):
    model = CostModel((0.0, 1e-3, 0.0), (0.01, 0.0, 0.0), (0.0, 1e9))  # 1 ms a prompt token
    p = SloPlanner(model, slo_ttft_s=3.5, slo_tpot_s=0.5, mode="overflow", admission=False)
    ls = loads("P0", "D0")
    ls["P0"].add(Job("queued", 3.0, 0, 0, False, queued_at=0.0))  # 1 s run, 2 s to go
    local = Route("local", "D0")
    alone = p.predict(3000, 50, local, ls, {}, now=1.0)
    assert alone.miss is None
    # a D prefilling for 3 s takes back the cores P had: P runs 1.8x slower meanwhile, the
    # queued prompt ends min(2 * 0.8, 3 * (1 - 1/1.8)) = 1.33 s later, past its 3.5 s
    p.coupled = {"P0": 1.8}
    shared = p.predict(3000, 50, local, ls, {}, now=1.0)
    assert shared.miss == "slo_ttft_queued" and shared.misses == 1
    assert shared.cost_s == pytest.approx(alone.cost_s + 3 * (1 - 1 / 1.8))
    short = p.predict(500, 50, local, ls, {}, now=1.0)  # 0.5 s: 0.22 s later, within it
    assert short.miss is None
    remote = p.predict(3000, 50, Route("remote", "P0", "D0"), ls, {}, now=1.0)
    assert remote.miss == "slo_ttft"  # P's own queue; its prompts are not stretched


def test_requests_reaching_d_during_the_answer_raise_its_predicted_tpot() -> None:
    p = planner()
    ls = loads("P0", "D0")
    route = Route("remote", "P0", "D0")
    alone = p.predict(1000, 100, route, ls, {}, now=10.0)
    # 100 steps of ~22 ms: as many join over those 2.2 s as arrived in the last 2.2 s (two;
    # the one at 5 s is older), each sharing half of it on average: one more in the batch
    for t in (5.0, 8.5, 9.5):
        p.arrivals.add(t)
    busy = p.predict(1000, 100, route, ls, {}, now=10.0)
    grow = MODEL.decode_step_s(2, 2100) - MODEL.decode_step_s(1, 1050)
    assert busy.tpot_s == pytest.approx(alone.tpot_s + grow)
    assert busy.ttft_s == alone.ttft_s
    # split over two decode workers, half a request joins each
    split = p.predict(1000, 100, route, ls, {}, now=10.0, decoders=2)
    half = MODEL.decode_step_s(1.5, 1575) - MODEL.decode_step_s(1, 1050)
    assert split.tpot_s == pytest.approx(alone.tpot_s + half)


def test_a_d_lent_every_core_decodes_new_requests_at_its_split_share() -> None:
    p = planner()
    ls = loads("P0", "D0")
    route = Route("remote", "P0", "D0")
    base = p.predict(1000, 100, route, ls, {}, now=0.0).tpot_s
    ls["D0"].slowness = 0.5  # two threads while P was idle
    assert p.predict(1000, 100, route, ls, {}, now=0.0).tpot_s < base
    ls["D0"].decode_slowness = 1.0  # the thread mover's price: its one-thread share
    assert p.predict(1000, 100, route, ls, {}, now=0.0).tpot_s == pytest.approx(base)
