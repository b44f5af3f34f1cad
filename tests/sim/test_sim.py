"""The simulator: event order and accounting on cases computed by hand, the step and link
models' arithmetic, workloads and traces, bad input, and (slow) the same routing decisions as a
real LocalCluster on the same request list."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.costmodel.model import CostModel
from pdserve.engine.scheduler import SchedulerPolicy
from pdserve.sim.cluster import Simulation
from pdserve.sim.hardware import ModelShape, gpu, model_shape
from pdserve.sim.records import SimConfig, SimRequest
from pdserve.sim.steptime import CostModelStep, Link, RooflineStep, planner_cost_model
from pdserve.sim.workload import arrivals, load_trace
from pdserve.workloads.spec import arrival_gaps


@dataclass(frozen=True)
class LinearStep:
    """step = a + b * tokens: easy to compute by hand."""

    a: float = 1.0
    b: float = 0.5
    kv_bytes_per_token: float = 100.0
    layers: int = 1
    gpus: int = 1
    tokens: int = 4096
    receive: float = 0.0  # D's work per received KV token

    def step_s(self, rows: Sequence[tuple[int, int]]) -> float:
        return self.a + self.b * sum(n for n, _ in rows)

    def receive_s(self, tokens: int) -> float:
        return self.receive * tokens

    def kv_tokens(self) -> int:
        return self.tokens


def req(rid: str, t: float, n: int, out: int, base: int = 100, conv: int = -1) -> SimRequest:
    return SimRequest(rid, t, [base + i for i in range(n)], out, conversation=conv)


def run(cfg: SimConfig, reqs: list[SimRequest], link: Link | None = None, step=None, **kw):  # type: ignore[no-untyped-def]
    sim = Simulation(cfg, step or LinearStep(), link or Link(1000.0, 0.25), **kw)
    records = sim.run(reqs)
    for w in sim.workers:  # leak check: everything freed (or only in a kept conversation
        # turn: free for the asking), nothing held or reserved
        assert w.kv.num_free_blocks + w.kv.num_kept_blocks == w.kv.num_blocks and w.idle, w.wid
    return sim, records


def test_colocated_one_request_by_hand() -> None:
    sim, (r,) = run(SimConfig(colocated=1), [req("a", 2.0, 4, 3)])
    # prefill 4 tokens: 1 + 2 = 3 s; then two decode steps of 1.5 s
    assert r.ttft == pytest.approx(3.0) and r.first_at == pytest.approx(5.0)
    assert r.finished_at == pytest.approx(8.0) and r.tokens == 3
    assert r.tpot == pytest.approx(1.5)
    assert sim.workers[0].steps == 3 and sim.workers[0].busy_s == pytest.approx(6.0)
    assert [what for _, what, _ in sim.workers[0].log] == ["prefill"]


def test_two_requests_batch_and_chunk_by_hand() -> None:
    # both arrive at 0, but a's arrival starts the idle worker at once: step 1 = a's 4 tokens
    # [0, 3]; budget 6: step 2 = a's decode + 5 of b's 6 (chunked) [3, 7]; step 3 = b's last
    # token [7, 8.5]; step 4 = b's decode [8.5, 10]
    cfg = SimConfig(colocated=1, policy=SchedulerPolicy(max_num_batched_tokens=6))
    sim, (a, b) = run(cfg, [req("a", 0.0, 4, 2), req("b", 0.0, 6, 2, base=500)])
    assert a.first_at == pytest.approx(3.0) and a.finished_at == pytest.approx(7.0)
    assert b.first_at == pytest.approx(8.5) and b.finished_at == pytest.approx(10.0)
    assert sim.workers[0].steps == 4
    assert [(what, rid) for _, what, rid in sim.workers[0].log] == [
        ("prefill", "a"),
        ("prefill", "b"),
    ]


def test_disaggregated_hand_off_by_hand() -> None:
    # P: 4-token prefill [0, 3]; KV 4 x 100 B over 1000 B/s on 1 layer = 0.4 s -> 3.4; + 0.25
    # per message -> D admits at 3.65; two decode steps of 1.5 s
    sim, (r,) = run(SimConfig(prefill=1, decode=1), [req("a", 0.0, 4, 3)])
    assert r.ttft == pytest.approx(3.0)
    assert r.finished_at == pytest.approx(3.65 + 3.0)
    assert r.tpot == pytest.approx((6.65 - 3.0) / 2)
    assert r.kv_bytes == 400 and r.route == "remote" and r.workers == ("P0", "D0")
    p, d = sim.workers
    assert [w for _, w, _ in d.log] == ["reserve", "admit"] and p.link.bytes_sent == 400


def test_link_streams_layer_by_layer() -> None:
    fast = Link(1e9, 0.0)  # keeps up: done one layer's bytes after the step
    assert fast.stream(0.0, 1.0, 1e6, 10, 0.0) == pytest.approx(1.0 + 1e-4)
    slow = Link(1e5, 0.0)  # 10 s of bytes: bound by the link from the first layer on
    assert slow.stream(0.0, 1.0, 1e6, 10, 0.0) == pytest.approx(0.1 + 10.0)
    assert slow.stream(0.0, 1.0, 1e5, 10, 0.0) == pytest.approx(10.1 + 1.0)  # FIFO behind
    late = Link(1e9, 0.0)  # D reserved only at 5 s: everything goes then
    assert late.stream(0.0, 1.0, 1e6, 10, 5.0) == pytest.approx(5.0 + 1e-3)


def test_reservation_waits_for_memory_like_the_engine() -> None:
    # D holds 6 blocks of 16 tokens: a reserves 4 (61 tokens), b's 4 must wait until a ends
    cfg = SimConfig(prefill=1, decode=1)
    small = Simulation(cfg, LinearStep(tokens=96), Link(1e6, 0.0))
    a, b = small.run([req("a", 0.0, 60, 20), req("b", 0.0, 60, 20, base=900)])
    assert a.tokens == b.tokens == 20 and a.finished_at is not None
    d = small.workers[1]
    reserved = {rid: t for t, w, rid in d.log if w == "reserve"}
    assert reserved["a"] == 0.0 and reserved["b"] == pytest.approx(a.finished_at)
    # P (6 blocks too) holds a's KV until it is sent: 6000 B at 1 MB/s ends at 31.006, then
    # b's prefill [31.006, 62.006], long before D can take it
    assert b.first_at == pytest.approx(62.006)
    assert d.kv.num_free_blocks == d.kv.num_blocks and small.workers[0].idle


def test_admission_rejects_what_no_route_can_meet() -> None:
    model = CostModel((1.0, 0.5, 0.0), (1.0, 0.5, 0.0))
    cfg = SimConfig(prefill=1, decode=1, planner=True, admission=True, slo_ttft_s=0.5)
    sim, (r,) = run(cfg, [req("a", 0.0, 4, 3)], planner_model=model)
    assert r.rejected == "slo_ttft" and r.first_at is None
    assert sim.counters == {"rejected_slo_ttft": 1}


def test_the_planner_learns_from_finished_requests_as_the_router_does() -> None:
    """Online calibration (router/timeline.py `score`): each finished request's actual TTFT and
    TPOT against its uncalibrated prediction move the planner's factors, which scale the next
    request's predictions. The model predicts half the real step: the ratio is 2."""
    half = CostModel((0.5, 0.25, 0.0), (0.5, 0.25, 0.0))
    cfg = SimConfig(colocated=1, planner=True)
    sim, (a, b) = run(cfg, [req("a", 0.0, 4, 3), req("b", 20.0, 4, 20, base=500)],
                      planner_model=half)  # fmt: skip
    # a: predicted 0.5 + 0.25 x 4 = 1.5 s on the idle worker, took 1 + 0.5 x 4 = 3 s
    assert a.predicted_ttft == pytest.approx(1.5) and a.ttft == pytest.approx(3.0)
    assert b.predicted_ttft == pytest.approx(1.5 * (0.8 + 0.2 * 2))  # scaled by what a taught
    # a's TTFT, b's TTFT and TPOT: a's 3 tokens are too short for its TPOT to count
    assert sim.planner is not None and sim.planner.calibration.samples == 3
    assert sim.planner.calibration.tpot > 1.0


def test_probes_teach_the_simulated_planner_before_the_run() -> None:
    """`simulate(probes=...)`: requests sent one at a time before the run (the validation's
    lone probes) calibrate the planner as they did the real router; with no planner, nothing."""
    from pdserve.sim.deploy import Built, probe_calibration

    half = CostModel((0.5, 0.25, 0.0), (0.5, 0.25, 0.0))
    cfg = SimConfig(colocated=1, planner=True)
    built = Built(cfg, LinearStep(), LinearStep(), Link(1000.0, 0.25), half, None)
    cal = probe_calibration(built, [req("p0", 0.0, 4, 3), req("p1", 0.0, 4, 3, base=500)])
    # each probe: TTFT 3 s (1 + 0.5 x 4) against 1.5 s predicted (0.5 + 0.25 x 4): ratio 2;
    # their 3-token TPOTs are too short to calibrate (slo.CALIBRATION_MIN_TOKENS), as in the router
    assert cal is not None and cal.samples == 2 and cal.tpot == 1.0
    learned = cal.ttft
    assert learned == pytest.approx(0.8 * (0.8 + 0.2 * 2) + 0.2 * 2)
    _, (a,) = run(cfg, [req("a", 0.0, 4, 3, base=900)], planner_model=half, calibration=cal)
    assert a.predicted_ttft == pytest.approx(1.5 * learned) and a.ttft == pytest.approx(3.0)
    unplanned = Built(
        SimConfig(colocated=1), LinearStep(), LinearStep(), Link(1e3, 0.0), None, None
    )
    assert probe_calibration(unplanned, [req("p0", 0.0, 4, 3)]) is None


def test_conditional_and_prefix_routing_follow_the_planner() -> None:
    model = CostModel((1.0, 0.5, 0.0), (1.0, 0.5, 0.0), (0.25, 1000.0))
    cfg = SimConfig(prefill=1, decode=2, planner=True, disaggregation="conditional",
                    prefix_routing=True, multiturn_reuse=False)  # fmt: skip
    shared = req("t0", 0.0, 40, 2, conv=0)
    turn2 = SimRequest("t1", 1.0, [*shared.prompt, 7, 7, 9, 9], 2, conversation=0, turn=1)
    _, (r0, r1) = run(cfg, [shared, turn2], planner_model=model)
    # idle cluster, no SLO: a local prefill on a D costs no transfer, so it wins
    assert r0.route == "local" and r1.route == "local"
    # the second turn goes where the first left its prefix, and finds it cached there
    assert r1.workers == r0.workers and r1.cached_tokens == 32
    assert r1.arrival >= r0.finished_at  # a turn waits for the previous one


def test_roofline_arithmetic() -> None:
    h100, shape = gpu("h100"), model_shape("llama-3.1-8b")
    assert 7.9e9 < shape.params < 8.1e9 and shape.kv_bytes_per_token == 131072
    one = RooflineStep(h100, shape, 1)
    weights = shape.weight_bytes / (h100.hbm_bytes_s * h100.mbu)
    assert one.step_s([(1, 100)]) == pytest.approx(
        weights + 101 * shape.kv_bytes_per_token / (h100.hbm_bytes_s * h100.mbu) + 0.0015
    )
    big = one.step_s([(4096, 0)])  # compute-bound: ~2 * 8e9 * 4096 flops
    assert big > 2 * shape.params * 4096 / (h100.bf16_flops * h100.mfu) * 0.9
    two = RooflineStep(h100, shape, 2)
    assert two.step_s([(1, 100)]) < one.step_s([(1, 100)])
    assert two.kv_tokens() > 2 * one.kv_tokens()  # the weights are paid once
    fitted = planner_cost_model(one)
    assert fitted.prefill_s(2000) == pytest.approx(one.step_s([(2000, 0)]), rel=0.3)


def test_cost_model_step_prices_a_mixed_batch() -> None:
    step = CostModelStep(CostModel((0.2, 0.01, 0.0), (0.1, 0.001, 0.5)))
    assert step.step_s([(100, 0)]) == pytest.approx(0.2 + 1.0)
    assert step.step_s([(1, 999)] * 2) == pytest.approx(0.1 + 0.002 + 0.5 * 2)
    assert step.step_s([(100, 0), (1, 999)]) == pytest.approx(0.2 + 1.0 + 0.001 + 0.5)


def test_cost_model_step_uses_the_per_batch_terms() -> None:
    # a(1) = 50 ms, a(2) = 150 ms, a(4) = 170 ms, 20 ms per 1k context; D0 = a(1)
    model = CostModel(
        (0.2, 0.01, 0.0),
        (0.1, 0.001, 0.5),
        decode_by_batch=((1, 0.05), (2, 0.15), (4, 0.17)),
        decode_context=0.02,
        receive=(0.001, 1e-5),
    )
    step = CostModelStep(model)
    assert step.step_s([(1, 99)]) == pytest.approx(0.05 + 0.002)
    assert step.step_s([(1, 99)] * 3) == pytest.approx(0.16 + 0.006)  # a(3): between 2 and 4
    # a prompt chunk beside them: the larger fixed cost (p0), the chunk, the decodes above D0
    mixed = 0.2 + 0.01 * 10 + (0.16 + 0.006 - 0.05)
    assert step.step_s([(10, 0), (1, 99), (1, 99), (1, 99)]) == pytest.approx(mixed)
    assert step.receive_s(100) == pytest.approx(0.002)


def test_decode_worker_receives_the_kv_before_its_next_step_by_hand() -> None:
    # D's receive: 0.25 s per KV token. a (4 tokens, 5 out): P [0, 3], KV at 3.4 + 0.25 = 3.65,
    # D receives [3.65, 4.65], decodes [4.65, 6.15], [6.15, 7.65], ... b (4 tokens, 2 out)
    # arrives at 1: P [3, 6], its KV at 6.4 + 0.25 = 6.65, while D runs a's step [6.15, 7.65]:
    # D receives after it [7.65, 8.65] (a waits too), then a + b [8.65, 10.65] (1 + 0.5 x 2):
    # b's second token ends it; a's last [10.65, 12.15]
    cfg = SimConfig(prefill=1, decode=1)
    sim = Simulation(cfg, LinearStep(receive=0.25), Link(1000.0, 0.25))
    a, b = sim.run([req("a", 0.0, 4, 5), req("b", 1.0, 4, 2, base=500)])
    assert a.first_at == pytest.approx(3.0) and b.first_at == pytest.approx(6.0)
    assert b.finished_at == pytest.approx(10.65) and a.finished_at == pytest.approx(12.15)
    assert a.tpot == pytest.approx((12.15 - 3.0) / 4)
    d = sim.workers[1]
    assert [(w, rid) for _, w, rid in d.log] == [
        ("reserve", "a"), ("reserve", "b"), ("admit", "a"), ("admit", "b")
    ]  # fmt: skip
    assert d.busy_s == pytest.approx(2 * 1.0 + 2 * 1.5 + 2.0 + 1.5)  # receives + steps
    assert d.kv.num_free_blocks == d.kv.num_blocks and d.idle and sim.workers[0].idle


def test_arrivals_and_trace(tmp_path: Path) -> None:
    ts = arrivals(2000, 4.0, 0)
    assert ts[0] == 0 and all(b >= a for a, b in itertools.pairwise(ts))
    assert 2000 / ts[-1] == pytest.approx(4.0, rel=0.1)
    bursty = arrivals(2000, 4.0, 0, cv=3.0)
    assert 2000 / bursty[-1] == pytest.approx(4.0, rel=0.35)
    # --bench-arrivals: bench serve's own send times, from its first request
    gaps = arrival_gaps(0.6, 1.0, 20, 3)
    sent = list(itertools.accumulate(gaps))
    replay = arrivals(20, 0.6, 3, bench=True)
    assert replay == pytest.approx([t - sent[0] for t in sent]) and replay != arrivals(20, 0.6, 3)
    bursty_gaps = arrival_gaps(0.6, 0.25, 20, 3)  # cv 2: gamma shape 1/4, bench's burstiness
    assert arrivals(20, 0.6, 3, cv=2.0, bench=True) == pytest.approx(
        [t - bursty_gaps[0] for t in itertools.accumulate(bursty_gaps)]
    )
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_timestamp,prompt_size,token_size\n10.0,5,2\n10.5,3,1\n")
    reqs = load_trace(trace)
    assert [(r.arrival, len(r.prompt), r.max_tokens) for r in reqs] == [(0.0, 5, 2), (0.5, 3, 1)]
    trace.write_text("arrival_s,input_tokens\n1,2\n")
    with pytest.raises(ValueError, match="output column"):
        load_trace(trace)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sim", "--hardware", "tpu"], "unknown hardware"),
        (["sim", "--model", "gpt-9"], "unknown model"),
        (["sim", "--model", "llama-3.1-70b", "--colocated", "1"], "does not fit"),
        (["sim", "--prefill", "1"], "--decode"),
        (["sim", "--admission", "--router", "round_robin"], "need --router planner"),
        (["sim", "--bench-arrivals", "--concurrency", "2"], "--bench-arrivals is for"),
    ],
)
def test_bad_input_is_a_clear_error(argv: list[str], message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_negative_rate_is_refused_by_argparse(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        main(["sim", "--rate", "-1"])
    assert "positive" in capsys.readouterr().err


def test_sim_cli_prints_the_summary(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = "sim --hardware h100 --colocated 1 --input-len 256 --output-len 8 --rate 5"
    assert (
        main([*argv.split(), "--num-requests", "20", "--slo-ttft", "1", "--slo-tpot", "0.1"]) == 0
    )
    out = capsys.readouterr().out
    assert "SLO attainment" in out and "goodput" in out


def test_plan_without_a_feasible_slo_says_so(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = (
        "plan --simulate --hardware h100 --model llama-3.1-8b --gpus 16 --input-len 2000 "
        "--output-len 50 --slo-ttft 0.001 --slo-tpot 0.0001"
    )
    assert main(argv.split()) == 1
    assert "no plan meets these SLOs" in capsys.readouterr().out


@pytest.mark.slow
def test_same_routing_decisions_as_a_real_cluster(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    """One request at a time through a real 1P2D cluster (round robin, then the planner with
    conditional disaggregation) and the simulator: the same route and workers per request."""
    from pdserve import SamplingParams
    from pdserve.cluster import LocalCluster
    from pdserve.router.slo import SloPlanner

    tiny = CostModel((0.002, 2e-5, 0.0), (0.002, 1e-4, 0.0), (0.0005, 1e9))
    lengths = [20, 40, 20, 60, 20, 40]
    reqs = [req(f"c{i}", 100.0 * i, n, 4, base=50 + 7 * i) for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for planner in (None, SloPlanner(tiny, mode="conditional")):
        core_args = {"planner": planner} if planner else {}
        real = []
        with LocalCluster(
            str(tiny_llama_path), prefill=1, decode=2, threads=1, core_args=core_args
        ) as c:
            for r in reqs:
                (out,) = c.generate([r.prompt], params, timeout_s=60)
                assert out.error is None
                route = next(e for e, _, _ in out.timeline if e.startswith("route: "))
                where = next(w for e, w, _ in out.timeline if e.startswith("route: "))
                real.append((route.removeprefix("route: "), where))
        cfg = SimConfig(prefill=1, decode=2, planner=planner is not None,
                        disaggregation="conditional")  # fmt: skip
        sim = Simulation(cfg, CostModelStep(tiny), Link(1e9, 0.0005), planner_model=tiny)
        sim.run(reqs)
        assert [(kind, where) for _, _, kind, where in sim.decisions] == real


def test_autobalance_moves_an_idle_prefill_worker_to_decode() -> None:
    # 20 long answers at once: D's batch is far over the TPOT budget (decode pressure >> 0.7)
    # while the P pool idles: after 5 simulated seconds the balancer drains a P and it decodes
    model = CostModel((0.01, 1e-4, 0.0), (0.01, 0.01, 0.0))
    cfg = SimConfig(prefill=2, decode=1, planner=True, autobalance=True, slo_tpot_s=0.1)
    reqs = [req(f"r{i}", 0.0, 8, 400, base=100 + 10 * i) for i in range(20)]
    sim = Simulation(cfg, LinearStep(a=0.05, b=0.001), Link(1e9, 0.0), planner_model=model)
    records = sim.run(reqs)
    assert all(r.tokens == 400 for r in records)
    assert sim.counters.get("autobalance_to_decode", 0) >= 1
    assert sim.counters.get("role_decode", 0) >= 1
    assert sorted(w.role for w in sim.workers).count("decode") >= 2
    for w in sim.workers:
        assert w.kv.num_free_blocks == w.kv.num_blocks and w.idle


def test_a_mixture_of_experts_holds_every_expert_and_computes_the_chosen_ones(
    tmp_path: Path,
) -> None:
    dense = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=96, vocab_size=320)  # fmt: skip
    (tmp_path / "config.json").write_text(
        json.dumps({**dense, "num_local_experts": 4, "num_experts_per_tok": 2})
    )
    moe, one = model_shape(str(tmp_path)), ModelShape.from_config("dense", dense)
    mlp = 3 * 64 * 96
    assert moe.layer_params == one.layer_params + 3 * mlp + 64 * 4  # + 3 experts, the router
    assert moe.active_layer_params == one.layer_params + mlp + 64 * 4
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelShape.from_config("bad", {**dense, "num_local_experts": 2, "num_experts_per_tok": 3})
    # Qwen3-MoE's spelling: num_experts, experts moe_intermediate_size wide
    qwen = {**dense, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    small = ModelShape.from_config("qwen3-moe", qwen)
    assert small.experts == 4 and small.intermediate == 32
    assert small.layer_params == one.layer_params - mlp + 4 * 3 * 64 * 32 + 64 * 4


def test_adaptive_moves_threads_with_the_real_policy_and_decodes_faster_alone() -> None:
    # one prompt, then a long answer: P idles while D decodes, so the policy (router/threads.py)
    # lends D both cores and its steps speed up by the cost model's thread scaling
    model = CostModel((0.01, 1e-4, 0.0), (0.01, 0.001, 0.0))
    reqs = [req("a", 0.0, 8, 200)]
    times = {}
    for cores in (0, 2):
        cfg = SimConfig(prefill=1, decode=1, planner=True, disaggregation="overflow",
                        thread_cores=cores)  # fmt: skip
        sim = Simulation(cfg, LinearStep(a=0.05, b=0.001), Link(1e9, 0.0), planner_model=model)
        (rec,) = sim.run(reqs)
        assert rec.tokens == 200 and rec.route == "remote"
        assert rec.last_at is not None
        times[cores] = rec.last_at
        if cores:
            # lent to D while it decoded, split again once both idle
            assert sim.counters["thread_moves"] >= 2 and sim.threads == {"P0": 1, "D0": 1}
        for w in sim.workers:
            assert w.kv.num_free_blocks == w.kv.num_blocks and w.idle
    assert times[2] < times[0]  # D decoded on two threads once P had parked
    with pytest.raises(ValueError, match="moving threads"):
        SimConfig(prefill=1, decode=1, thread_cores=2)


def test_adaptive_d_holds_within_tpot_slack_so_ps_prompts_run_on_every_core() -> None:
    # D decodes a long answer while three prompts reach P: with TPOT to spare, D holds its
    # steps and P prefills on both cores (router/threads.py `hold_decode`); at a TPOT SLO the
    # answer's steps already fill, D never holds and P prefills on one core
    model = CostModel((0.01, 1e-3, 0.0), (0.01, 0.0, 0.0))
    reqs = [req("a", 0.0, 8, 300)] + [req(f"p{i}", 0.5, 400, 4, base=1000 * (i + 1))
                                      for i in range(3)]  # fmt: skip
    ttft, tpot = {}, {}
    for slo_tpot in (1.0, 0.0105):
        cfg = SimConfig(prefill=1, decode=1, planner=True, disaggregation="overflow",
                        thread_cores=2, slo_tpot_s=slo_tpot)  # fmt: skip
        sim = Simulation(cfg, LinearStep(a=0.01, b=1e-3), Link(1e9, 0.0), planner_model=model)
        records = {r.rid: r for r in sim.run(reqs)}
        assert all(r.tokens == r.max_tokens for r in records.values())
        held = sim.counters.get("decode_holds", 0)
        assert (held >= 1) == (slo_tpot == 1.0)
        ttft[slo_tpot] = max(records[f"p{i}"].first_at for i in range(3))  # type: ignore[type-var]
        a = records["a"]
        tpot[slo_tpot] = (a.last_at - a.first_at) / (a.tokens - 1)  # type: ignore[operator]
        for w in sim.workers:
            assert w.kv.num_free_blocks == w.kv.num_blocks and w.idle and not w.held
    assert ttft[1.0] < ttft[0.0105]  # the prompts came sooner with D held
    assert tpot[1.0] <= 1.0  # and the held answer stayed within its SLO


def test_adaptive_admits_as_the_served_adaptive_deployment_does() -> None:
    """`pdserve serve --adaptive` refuses predicted SLO misses by default; the simulated one
    does too unless told --no-admission, and admission stays opt-in elsewhere."""
    import argparse

    from pdserve.sim import cli

    def deployment(*argv: str):  # type: ignore[no-untyped-def]
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        return cli.deployment_from_args(p.parse_args(["--hardware", "cpu", *argv]))

    assert deployment("--adaptive").admission
    # as served: P's steps are the shared budget, capped by the thread mover while it is short
    # of cores (`ThreadPolicy.step_tokens`)
    assert deployment("--adaptive").prefill_batched_tokens is None
    assert deployment("--prefill", "1", "--decode", "1").prefill_batched_tokens is None
    assert not deployment("--adaptive", "--no-admission").admission
    assert not deployment("--prefill", "1", "--decode", "1", "--slo-ttft", "2").admission
    assert deployment("--prefill", "1", "--decode", "1", "--slo-ttft", "2", "--admission").admission
