"""The shared-host contention model: the factors' arithmetic and storage, the host's processor
sharing and a two-worker simulation computed by hand, and (slow) the concurrent profile."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from tests.sim.test_sim import LinearStep

from pdserve.costmodel.contention import Contention, Shapes, measure
from pdserve.costmodel.model import VERSION, CostModel
from pdserve.engine.step_log import StepRecord
from pdserve.sim.cluster import Simulation
from pdserve.sim.host import Host, step_kind
from pdserve.sim.records import SimConfig, SimRequest
from pdserve.sim.steptime import CostModelStep, Link

FACTORS = Contention(
    prefill_by_prefill=2.0, prefill_by_decode=1.5, decode_by_prefill=3.0, decode_by_decode=1.0
)


class Clock:
    """A minimal event loop for the host alone."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events: list[tuple[float, int, object]] = []

    def at(self, t: float, fn) -> None:  # type: ignore[no-untyped-def]
        self.events.append((t, len(self.events), fn))

    def run(self) -> None:
        while self.events:
            self.events.sort(key=lambda e: (e[0], e[1]))
            t, _, fn = self.events.pop(0)
            self.now = t
            fn()  # type: ignore[operator]


def test_host_stretches_overlapping_steps_by_hand() -> None:
    # prefill (work 1.0) from 0, decode (work 0.5) from 0.2: from 0.2 the prefill runs at 1/2,
    # the decode at 1/1.5 -> decode ends 0.2 + 0.75 = 0.95; the prefill has 1 - 0.2 - 0.375 =
    # 0.425 left, alone: ends 1.375
    clock = Clock()
    c = Contention(prefill_by_decode=2.0, decode_by_prefill=1.5)
    host = Host(c, clock.at, lambda: clock.now)
    ends: dict[str, float] = {}
    host.start(0.0, "A", "prefill", 1.0, lambda: ends.setdefault("A", clock.now))
    b_done = lambda: ends.setdefault("B", clock.now)  # noqa: E731
    clock.at(0.2, lambda: host.start(0.2, "B", "decode", 0.5, b_done))
    clock.run()
    assert ends["B"] == pytest.approx(0.95) and ends["A"] == pytest.approx(1.375)
    assert not host.running


def test_a_superseded_end_never_ends_the_workers_next_step() -> None:
    """A's first step (work 1.0) starts beside B's prefill at rate 1/2, so its first end event
    is queued at 2.0; B ends at 0.5 and A's end moves to 0.5 + (1 - 0.25) = 1.25. A starts its
    next step (work 1.0) at once: it must end at 2.25, not at the superseded 2.0 (it did when
    each step numbered its own end events from 1: the new step's first number matched the
    stale event's)."""
    clock = Clock()
    host = Host(Contention(decode_by_prefill=2.0), clock.at, lambda: clock.now)
    ends: list[tuple[str, float]] = []

    def a_done(n: int) -> None:
        ends.append((f"A{n}", clock.now))
        if n == 1:
            host.start(clock.now, "A", "decode", 1.0, lambda: a_done(2))

    host.start(0.0, "B", "prefill", 0.5, lambda: ends.append(("B", clock.now)))
    host.start(0.0, "A", "decode", 1.0, lambda: a_done(1))  # beside B: rate 1/2 from the start
    clock.run()
    assert [name for name, _ in ends] == ["B", "A1", "A2"]
    assert [t for _, t in ends] == pytest.approx([0.5, 1.25, 2.25])
    assert not host.running


def test_host_alone_and_factor_one_change_nothing() -> None:
    clock = Clock()
    host = Host(Contention.none(), clock.at, lambda: clock.now)
    ends: dict[str, float] = {}
    host.start(0.0, "A", "prefill", 1.0, lambda: ends.setdefault("A", clock.now))
    host.start(0.0, "B", "decode", 0.25, lambda: ends.setdefault("B", clock.now))
    clock.run()
    assert ends == {"A": pytest.approx(1.0), "B": pytest.approx(0.25)}
    with pytest.raises(ValueError, match="already"):
        host.start(2.0, "A", "decode", 1.0, lambda: None)
        host.start(2.0, "A", "decode", 1.0, lambda: None)


def test_slowdown_table_and_oversubscription() -> None:
    assert FACTORS.slowdown("decode", []) == 1.0
    assert FACTORS.slowdown("decode", ["decode"]) == 1.0
    assert FACTORS.slowdown("decode", ["decode", "prefill"]) == 3.0  # the heavier neighbour
    # 3 busy workers x 1 thread on 2 cores: x 3/2 over the profiled 2 threads on 2 cores
    on_two = Contention(prefill_by_decode=1.5, threads=1, cores=2)
    assert on_two.slowdown("prefill", ["decode"]) == 1.5
    assert on_two.slowdown("prefill", ["decode", "decode"]) == pytest.approx(2.25)
    assert step_kind([(1, 40), (1, 7)]) == "decode"
    assert step_kind([(1, 40), (16, 0)]) == "prefill" and step_kind([(1, 0)]) == "prefill"
    with pytest.raises(ValueError, match="> 0"):
        Contention(decode_by_prefill=0.0)


def test_fit_takes_median_ratios_and_never_speeds_up() -> None:
    c = Contention.fit(
        {"prefill": [1.0, 1.0, 9.0], "decode": [0.1, 0.1, 0.1]},
        {
            ("prefill", "decode"): [1.2, 1.2, 1.3],
            ("prefill", "prefill"): [2.0],
            ("decode", "prefill"): [0.3, 0.2, 0.2],
            ("decode", "decode"): [0.09],  # faster than alone: noise, clamped to 1
        },
        threads=1,
        cores=2,
    )
    assert c.prefill_by_decode == pytest.approx(1.2) and c.prefill_by_prefill == 2.0
    assert c.decode_by_prefill == pytest.approx(2.0) and c.decode_by_decode == 1.0
    with pytest.raises(ValueError, match="no prefill samples"):
        Contention.fit({"prefill": [1.0]}, {}, 1, 2)


def test_stored_in_the_cost_model_file_and_old_files_load_with_factor_one(tmp_path: Path) -> None:
    path = tmp_path / "cm.json"
    model = CostModel((0.1, 0.01, 0.001), (0.05, 0.001, 0.01))
    model.save(path, threads=1)
    body = json.loads(path.read_text())
    body["version"] = 1  # a file written before contention existed
    path.write_text(json.dumps(body))
    old = Contention.load(path)
    assert not old.measured and old.slowdown("decode", ["prefill"]) == 1.0
    assert "factor 1" in old.note
    FACTORS.save_into(path)
    assert Contention.load(path) == FACTORS
    assert CostModel.load(path) == model and CostModel.load_about(path) == {"threads": 1}
    assert json.loads(path.read_text())["version"] == VERSION  # v3 terms absent: defaults
    body["contention"] = {"decode_by_prefill": 2}
    path.write_text(json.dumps(body))
    with pytest.raises(ValueError, match="malformed contention"):
        Contention.load(path)


def test_two_colocated_workers_share_the_host_by_hand() -> None:
    # LinearStep: 1 + 0.5 / token. a (4 tokens, 2 out) on C0 at 0: prefill work 3; b (1 token,
    # 2 out) on C1 at 1: prefill work 1.5. [1, 4]: both prefill at 1/2 -> b's prefill ends at 4,
    # a has 0.5 left. At 4, b decodes (work 1.5) beside a's prefill: a at 1/1.5 ends 4.75; b at
    # 1/3 has 1.25 left. At 4.75 a decodes (work 1.5) beside b's decode (x1): b ends 6.0, a 6.25.
    reqs = [
        SimRequest("a", 0.0, [100, 101, 102, 103], 2),
        SimRequest("b", 1.0, [500], 2),
    ]
    sim = Simulation(SimConfig(colocated=2), LinearStep(), Link(1000.0, 0.25), contention=FACTORS)
    a, b = sim.run(reqs)
    assert a.workers == ("C0",) and b.workers == ("C1",)
    assert a.first_at == pytest.approx(4.75) and a.finished_at == pytest.approx(6.25)
    assert b.first_at == pytest.approx(4.0) and b.finished_at == pytest.approx(6.0)
    c0, c1 = sim.workers
    assert c0.busy_s == pytest.approx(6.25) and c1.busy_s == pytest.approx(5.0)
    # independent machines (the GPU case): a 3 + 1.5, b 1 + 1.5 + 1.5
    a2, b2 = Simulation(SimConfig(colocated=2), LinearStep(), Link(1000.0, 0.25)).run(reqs)
    assert (a2.first_at, a2.finished_at, b2.first_at, b2.finished_at) == pytest.approx(
        (3.0, 4.5, 2.5, 4.0)
    )


@pytest.mark.slow
def test_concurrent_profile_measures_two_engines(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    got = measure(str(tiny_llama_path), 1, Shapes(prompt=32, batch=2, context=32, seconds=0.3))
    c = got["contention"]
    assert c.measured and c.threads == 1 and c.cores >= 1
    assert set(got["alone"]) == {"prefill", "decode"} and all(got["alone"].values())
    assert {"decode_by_prefill", "prefill_by_decode"} <= set(got["together"])
    assert all(c.table(k, o) >= 1.0 for k in ("prefill", "decode") for o in ("prefill", "decode"))


def test_validation_report_puts_errors_beside_the_aa_spread() -> None:
    from pdserve.sim.validate_report import compare, report

    def summary(ttft: float, tpot: float, att: float) -> dict:  # type: ignore[type-arg]
        return {
            "ttft_s": {"p50": ttft, "p90": 2 * ttft},
            "tpot_s": {"p50": tpot, "p90": 2 * tpot},
            "attainment": att,
        }

    real_a, real_b, sim = summary(1.0, 0.1, 0.5), summary(1.2, 0.1, 0.5), summary(0.9, 0.12, 0.6)
    vs = compare(real_a, sim)
    assert vs["ttft_p50_err"] == pytest.approx(-0.1) and vs["tpot_p90_err"] == pytest.approx(0.2)
    assert vs["attainment_diff_pts"] == pytest.approx(10.0)
    row = {"case": "c", "real": [real_a, real_b], "sim": sim, "vs": vs, "vs_independent": vs,
           "vs_calibrated": vs, "aa": compare(real_a, real_b)}  # fmt: skip
    other = {**row, "case": "d"}
    del other["aa"]
    lines = report([row, other]).splitlines()
    assert lines[2] == "| c | TTFT p50 ms | 1000 | 900 | -10% | -10% | -10% | +20% |"
    assert lines[6] == "| c | attainment | 50% | 60% | +10 pts | +10 pts | +10 pts | +0 pts |"
    assert lines[7].endswith("| +20% (first config's) |")


def test_validation_reports_every_run_at_its_own_level() -> None:
    from pdserve.sim.validate_report import report_runs

    def summary(ttft: float, tpot: float, att: float) -> dict:  # type: ignore[type-arg]
        return {"ttft_s": {"p50": ttft, "p90": ttft}, "tpot_s": {"p50": tpot, "p90": tpot},
                "attainment": att}  # fmt: skip

    factors = {"prefill_x": 1.05, "decode_x": 0.875}
    row = {"case": "c", "real": [summary(1.0, 0.1, 0.5), summary(2.0, 0.1, 0.75)],
           "calibrated": [{"factors": factors, "sim": summary(1.1, 0.09, 0.55)},
                          {"factors": factors, "sim": summary(1.0, 0.1, 0.7)}]}  # fmt: skip
    lines = report_runs([row]).splitlines()
    assert (
        lines[2] == "| c | 1 | +10% | +10% | -10% | -10% | 50.0% / 55.0% (+5.0 pts) | 1.05 / 0.88 |"
    )
    assert (
        lines[3] == "| c | 2 | -50% | -50% | +0% | +0% | 75.0% / 70.0% (-5.0 pts) | 1.05 / 0.88 |"
    )


def test_cpu_deployment_reads_the_contention_from_the_cost_model_file(tmp_path: Path) -> None:
    from pdserve.sim.deploy import Deployment, simulate

    path = tmp_path / "cm.json"
    CostModel((0.1, 0.002, 0.0), (0.05, 0.001, 0.0)).save(path, kv_bytes_per_token=1000)
    reqs = [SimRequest(f"r{i}", 0.1 * i, [100 + 50 * i + j for j in range(64)], 4)
            for i in range(4)]  # fmt: skip
    d = Deployment(hardware="cpu", model="default", prefill=0, decode=0, colocated=2,
                   cost_model=path)  # fmt: skip
    old = simulate(d, reqs)
    assert "factor 1" in old["contention"]
    assert old["ttft_s"] == simulate(replace(d, shared_host=False), reqs)["ttft_s"]
    FACTORS.save_into(path)
    shared = simulate(d, reqs)
    alone = simulate(replace(d, shared_host=False), reqs)
    assert "x3.00 beside a prefill" in shared["contention"] and "contention" not in alone
    assert shared["ttft_s"]["p50"] > alone["ttft_s"]["p50"]
    assert shared["utilization"]["colocated"] > alone["utilization"]["colocated"]


def test_validation_slos_come_from_the_less_disturbed_probe() -> None:
    import argparse

    from pdserve.sim.records import Record
    from pdserve.sim.validate import slos_from_probes

    def probe(rid: str, ttft: float, tpot: float) -> Record:  # 8 tokens: 7 gaps of `tpot`
        return Record(rid, 256, 8, None, arrival=0.0, first_at=ttft, last_at=ttft + 7 * tpot,
                      tokens=8)  # fmt: skip

    probes = [probe("a", 0.8, 0.06), probe("b", 0.7, 0.05)]
    args = argparse.Namespace(slo_ttft=None, slo_tpot=None, slo_ttft_x=1.5, slo_tpot_x=1.25)
    assert slos_from_probes(args, probes) == (pytest.approx(1.05), pytest.approx(0.0625))
    args.slo_tpot = 0.2  # given: kept
    assert slos_from_probes(args, probes)[1] == 0.2
    with pytest.raises(RuntimeError, match="no timings"):
        slos_from_probes(args, [Record("c", 256, 8, None, rejected="slo_ttft")])


def test_resimulate_checks_the_simulator_against_stored_real_runs(tmp_path: Path) -> None:
    """`validate --resimulate`: the real runs kept in an earlier output are simulated again with
    this code. Stored "real" runs that are this simulator's own output must come back exact."""
    from dataclasses import asdict

    from pdserve.sim import validate as V
    from pdserve.sim.deploy import simulate
    from pdserve.sim.workload import arrivals, requests_from_items
    from pdserve.workloads.streams import SyntheticWorkload

    path = tmp_path / "cm.json"
    CostModel((0.1, 0.002, 0.0), (0.05, 0.001, 0.0)).save(path, kv_bytes_per_token=1000)
    FACTORS.save_into(path)
    items = list(SyntheticWorkload(6, 64, 4, 0.25, 0))
    reqs = requests_from_items(items, arrivals(6, 2.0, 0))
    case = next(c for c in V.cases() if c.name == "1P1D")
    d = replace(case.deployment, cost_model=path, expected_output=4, slo_ttft_s=1.0,
                slo_tpot_s=0.1)  # fmt: skip
    recs: list = []
    probes: list = []
    simulate(d, reqs, records_out=recs)
    simulate(d, V.probe_requests(64), records_out=probes)
    row = {"case": "1P1D", "real_records": [[asdict(r) for r in recs]],
           "real_probes": [[asdict(r) for r in probes]]}  # fmt: skip
    args = {"num_requests": 6, "input_len": 64, "output_len": 4, "rate": 2.0, "seed": 0,
            "cost_model": str(path)}  # fmt: skip
    src, out = tmp_path / "v.json", tmp_path / "again.json"
    src.write_text(json.dumps({"args": args, "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
                               "results": [row]}))  # fmt: skip
    V.main(["--resimulate", str(src), "--out", str(out)])
    got = json.loads(out.read_text())
    vs = got["results"][0]["vs"]
    assert vs["attainment_diff_pts"] == 0
    assert all(v == pytest.approx(0.0) for k, v in vs.items() if k.endswith("_err")), vs
    assert got["resimulated_from"] == str(src)
    assert got["results"][0]["calibrated"][0]["factors"]["from"] == "probes"  # no step logs
    # with step logs: the run's level, 1.2x the model's prefill steps and 0.9x its decode steps
    step = CostModelStep(CostModel.load(path))
    logs = {"P": [StepRecord(i, 1.2 * step.priced(0, 0, [(64, 0)]), 0, 0, ((64, 0),))
                  for i in range(5)],
            "D": [StepRecord(10 + i, 0.9 * step.priced(2, 140, []), 2, 140, ())
                  for i in range(5)]}  # fmt: skip
    row["real_steps"] = [{w: [s.to_wire() for s in log] for w, log in logs.items()}]
    src.write_text(json.dumps({"args": args, "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
                               "results": [row]}))  # fmt: skip
    V.main(["--resimulate", str(src), "--out", str(out)])
    factors = json.loads(out.read_text())["results"][0]["calibrated"][0]["factors"]
    assert factors["from"] == "steps" and factors["fallback"] == []
    assert factors["prefill_x"] == pytest.approx(1.2) and factors["decode_x"] == pytest.approx(0.9)
    last = json.loads(out.read_text())["runs_table"].splitlines()[-1]
    assert last.startswith("| 1P1D | 1 |") and last.endswith("| 1.20 / 0.90 |")
    del row["real_records"]
    src.write_text(json.dumps({"args": args, "slo": {"ttft_s": 1, "tpot_s": 1}, "results": [row]}))
    with pytest.raises(SystemExit, match="no real_records"):
        V.main(["--resimulate", str(src), "--out", str(out)])
