"""`pdserve plan`'s arithmetic on synthetic cost models (no engine): the queueing formulas, the
capacities' monotonicity in the SLOs, what a workload's shape does to the recommended split,
unattainable SLOs, and the command line end to end on a saved model."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.costmodel import capacity, plan, plan_cli
from pdserve.costmodel.capacity import SLO, Shape
from pdserve.costmodel.model import CostModel

# about SmolLM2-135M on one thread: 50 ms + 1.8 ms/token prefill, 45 ms decode steps
MODEL = CostModel((0.05, 0.0018, 0.0004), (0.045, 0.004, 0.009), (0.001, 1e9))
KV_BYTES = 46080


def test_md1_utilization_meets_the_limit_exactly() -> None:
    s, limit = 2.0, 5.0
    rho = capacity.max_md1_utilization(s, limit)
    assert 0 < rho < 1
    assert capacity.md1_wait(rho, s) + s == pytest.approx(limit)
    assert capacity.max_md1_utilization(6.0, limit) == 0.0
    assert capacity.md1_wait(1.0, s) == float("inf")


def test_prefill_capacity_matches_the_formula() -> None:
    shape = Shape(1000, 100)
    cap = capacity.prefill_capacity(MODEL, shape, 10.0)
    assert cap.service_s == pytest.approx(MODEL.prefill_s(1000))
    assert cap.rate == pytest.approx(cap.utilization / cap.service_s)
    assert capacity.md1_wait(cap.utilization, cap.service_s) + cap.service_s == pytest.approx(10.0)
    cached = capacity.prefill_capacity(MODEL, Shape(1000, 100, cached_len=512), 10.0)
    assert cached.service_s < cap.service_s and cached.rate > cap.rate


def test_decode_capacity_is_the_largest_batch_within_the_slo() -> None:
    shape = Shape(500, 200)
    cap = capacity.decode_capacity(MODEL, shape, 0.2)
    assert (
        capacity.decode_tpot(MODEL, shape, cap.batch)
        <= 0.2
        < capacity.decode_tpot(MODEL, shape, cap.batch + 1)
    )
    assert cap.limit == "tpot"
    assert cap.rate == pytest.approx(cap.batch / (shape.decode_steps * cap.step_s))
    # KV memory for 3 requests: the batch stops there
    kv = capacity.decode_capacity(MODEL, shape, 0.2, max_kv_tokens=3 * shape.final_context)
    assert kv.batch == 3 and kv.limit == "kv" and kv.rate < cap.rate
    # the transfer delays the second token: a slow link costs TPOT
    slow = CostModel(MODEL.prefill, MODEL.decode, (0.0, 1e6))
    assert capacity.decode_capacity(slow, shape, 0.2, kv_bytes_per_token=KV_BYTES).batch < cap.batch


def test_capacities_grow_with_the_slos() -> None:
    shape = Shape(1500, 150)
    ttfts, tpots = [1.0, 3.0, 6.0, 12.0, 30.0], [0.05, 0.08, 0.12, 0.3, 1.0]
    pre = [capacity.prefill_capacity(MODEL, shape, t).rate for t in ttfts]
    dec = [capacity.decode_capacity(MODEL, shape, t).rate for t in tpots]
    col = [capacity.colocated_capacity(MODEL, shape, SLO(t, p)).rate for t in ttfts for p in tpots]
    assert pre == sorted(pre) and pre[0] == 0 < pre[-1]
    assert dec == sorted(dec) and dec[0] == 0 < dec[-1]
    grid = [col[i * len(tpots) : (i + 1) * len(tpots)] for i in range(len(ttfts))]
    for row in grid:
        assert row == sorted(row)
    for column in zip(*grid, strict=True):
        assert list(column) == sorted(column)


def test_colocated_state_at_no_load_and_its_limit() -> None:
    shape = Shape(800, 100)
    idle = capacity.colocated_state(MODEL, shape, 0.0)
    assert idle is not None
    assert idle.ttft_s == pytest.approx(MODEL.prefill_s(800))
    assert idle.tpot_s == pytest.approx(MODEL.decode_step_s(1, round(shape.mean_context)))
    slo = SLO(5.0, 0.1)
    cap = capacity.colocated_capacity(MODEL, shape, slo)
    assert cap.rate > 0 and cap.limit in ("ttft", "tpot")
    assert cap.state.ttft_s <= slo.ttft_s * 1.001 and cap.state.tpot_s <= slo.tpot_s * 1.001
    busier = capacity.colocated_state(MODEL, shape, cap.rate * 1.05)
    assert busier is None or busier.ttft_s > slo.ttft_s or busier.tpot_s > slo.tpot_s
    # prefill load stalls decodes: TPOT under load exceeds the idle step
    assert cap.state.tpot_s > idle.tpot_s


def _best_split(shape: Shape, slo: SLO) -> plan.Candidate:
    p = plan.make_plan({1: MODEL}, shape, slo, 8, colocated=False)
    assert p.recommended is not None, p.why
    return p.recommended


def test_a_prefill_heavy_workload_gets_more_prefill_workers() -> None:
    heavy_p = _best_split(Shape(3000, 20), SLO(20.0, 0.2))
    heavy_d = _best_split(Shape(100, 1000), SLO(20.0, 0.2))
    share = lambda c: c.workers / (c.workers + c.d_workers)  # noqa: E731
    assert share(heavy_p) > share(heavy_d), (heavy_p.label, heavy_d.label)
    assert heavy_p.workers > heavy_d.workers and heavy_d.d_workers > heavy_p.d_workers


def test_every_split_fits_the_cores_and_the_list_is_sorted() -> None:
    models = {t: capacity.worker_model(MODEL, t) for t in (1, 2, 4)}
    cands = plan.enumerate_candidates(models, Shape(1000, 100), SLO(8.0, 0.1), 6)
    assert all(c.cores <= 6 for c in cands)
    assert [c.goodput for c in cands] == sorted((c.goodput for c in cands), reverse=True)
    labels = {c.label for c in cands}
    assert "1P x2t + 1D x4t" in labels and "3 colocated x2t" in labels
    assert len(labels) == len(cands)
    split = next(c for c in cands if c.kind == "disaggregated" and c.goodput > 0)
    assert split.goodput == pytest.approx(min(split.p_rate or 0, split.d_rate or 0))


def test_unattainable_slos_are_reported_not_raised() -> None:
    p = plan.make_plan({1: MODEL, 2: capacity.worker_model(MODEL, 2)}, Shape(2000, 100),
                       SLO(0.5, 0.01), 2)  # fmt: skip
    assert p.recommended is None
    assert "No split meets the SLOs" in p.why and "TTFT" in p.why and "TPOT" in p.why
    assert all(c.goodput == 0 for c in p.candidates)
    assert "No split meets" in plan_cli.render_text(p)
    assert plan_cli.plan_json(p)["feasible"] is False


def test_thread_scaling() -> None:
    assert capacity.speedup(1) == 1 and capacity.speedup(2, 0.8) == pytest.approx(1.8)
    two = capacity.worker_model(MODEL, 2, efficiency=0.5)
    assert two.prefill_s(1000) == pytest.approx(MODEL.prefill_s(1000) / 1.5)
    assert two.transfer == MODEL.transfer
    measured = CostModel((1.0, 0.0, 0.0), (1.0, 0.0, 0.0))
    assert capacity.worker_model(MODEL, 2, measured={2: measured}) is measured
    # a base measured with 2 threads, asked for 1: slower by speedup(2)
    one = capacity.worker_model(MODEL, 1, base_threads=2, efficiency=1.0)
    assert one.decode_step_s(1, 100) == pytest.approx(2 * MODEL.decode_step_s(1, 100))
    with pytest.raises(ValueError, match="efficiency"):
        capacity.speedup(2, 0.0)


def test_bad_inputs_are_value_errors() -> None:
    with pytest.raises(ValueError, match="input_len"):
        Shape(0, 10)
    with pytest.raises(ValueError, match="output_len"):
        Shape(10, 1)
    with pytest.raises(ValueError, match="cached_len"):
        Shape(10, 10, cached_len=10)
    with pytest.raises(ValueError, match="SLO"):
        SLO(0.0, 0.1)
    with pytest.raises(ValueError, match="cores"):
        plan.enumerate_candidates({1: MODEL}, Shape(10, 10), SLO(1, 1), 0)
    with pytest.raises(ValueError, match="thread option"):
        plan.enumerate_candidates({4: MODEL}, Shape(10, 10), SLO(1, 1), 2)
    with pytest.raises(ValueError, match="workload"):
        plan.default_cached_len("chat", 100)
    assert plan.default_cached_len("rag", 2000) == 48 and plan.default_cached_len("rag", 20) == 16
    assert plan.default_cached_len("synthetic", 2000) == 0
    assert plan_cli.default_threads_options(6) == [1, 2, 4, 6]


def test_load_models_prefers_a_measured_sibling(tmp_path: Path) -> None:
    base = tmp_path / "host-model-t1.json"
    MODEL.save(base, threads=1)
    measured = MODEL.scaled(0.7)
    measured.save(tmp_path / "host-model-t2.json", threads=2)
    models, sources = plan_cli.load_models(base, [1, 2, 4])
    assert models[1] == MODEL and models[2] == measured
    assert models[4].prefill_s(100) == pytest.approx(MODEL.prefill_s(100) / capacity.speedup(4))
    assert "measured" in sources[2] and "scaled" in sources[4]
    assert plan_cli.sibling_path(tmp_path / "cm.json", 2) is None
    with pytest.raises(ValueError, match="bench profile"):
        plan_cli.load_models(tmp_path / "missing-t1.json", [1])


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(["plan", *argv])
        except SystemExit as e:  # argparse errors
            rc = int(e.code or 0)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "host-model-t1.json"
    MODEL.save(path, threads=1, kv_bytes_per_token=KV_BYTES)
    return path


def test_cli_prints_a_recommendation(saved: Path) -> None:
    args = ["--workload", "rag", "--input-len", "2000", "--output-len", "300", "--slo-ttft", "8",
            "--slo-tpot", "0.1", "--cores", "2", "--cost-model", str(saved)]  # fmt: skip
    rc, out, _ = _cli(*args)
    assert rc == 0, out
    assert "Recommended:" in out and "Runner-up:" in out and "1P x1t + 1D x1t" in out
    assert "(48 cached)" in out and "scaled from 1 thread" in out
    rc, out, _ = _cli(*args, "--json")
    body = json.loads(out)
    assert rc == 0 and body["feasible"] and body["recommended"]["goodput"] > 0
    assert len(body["candidates"]) == 4  # 1P1D, 1 x1t, 2 x1t, 1 x2t


def test_cli_unattainable_and_bad_arguments(saved: Path, tmp_path: Path) -> None:
    base = ["--input-len", "2000", "--output-len", "300", "--cores", "2"]
    rc, out, _ = _cli(*base, "--slo-ttft", "0.1", "--slo-tpot", "0.001", "--cost-model", str(saved))
    assert rc == 1 and "No split meets the SLOs" in out
    rc, _, err = _cli(*base, "--slo-ttft", "8", "--slo-tpot", "0.1",
                      "--cost-model", str(tmp_path / "none-t1.json"))  # fmt: skip
    assert rc == 2 and "bench profile" in err
    rc, _, err = _cli(*base, "--slo-ttft", "8", "--slo-tpot", "-1", "--cost-model", str(saved))
    assert rc == 2 and "positive" in err
    rc, _, err = _cli(*base, "--slo-ttft", "8", "--slo-tpot", "0.1", "--threads-options", "1,4",
                      "--cost-model", str(saved))  # fmt: skip
    assert rc == 2 and "--cores" in err
    rc, _, err = _cli(*base, "--slo-ttft", "8", "--slo-tpot", "0.1", "--cached-len", "5000",
                      "--cost-model", str(saved))  # fmt: skip
    assert rc == 2 and "cached_len" in err


def test_colocated_state_with_a_decode_term_per_batch_size_by_hand() -> None:
    # 1 ms per prompt token; a step: 50 ms at one row, 150 ms at two (+100 ms a row past one)
    model = CostModel((0.0, 0.001, 0.0), (0.05, 0.1, 0.0), decode_by_batch=((1, 0.05), (2, 0.15)))
    shape = Shape(100, 11)  # S = 0.1 s, 10 decode steps
    # 1 req/s: rho_p = 0.1, k = 10 / 0.9; N = k x 50 ms = 0.556 (below one row: 50 ms steps)
    st = capacity.colocated_state(model, shape, 1.0)
    assert st is not None
    assert st.batch == pytest.approx(10 / 0.9 * 0.05, rel=1e-6)
    assert st.tpot_s == pytest.approx(0.05 / 0.9)
    assert st.ttft_s == pytest.approx(0.1 + capacity.md1_wait(0.1, 0.1))
    # 2 req/s: k = 25; k x step(N) > N for every N (a second row costs 100 ms): unstable
    assert capacity.colocated_state(model, shape, 2.0) is None
