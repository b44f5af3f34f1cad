"""One `Deployment` (pdserve/deployment.py) from the command line, a YAML file or Python, and the
same description reaching serve's worker specs, LocalCluster, the Ray pool spec and the
simulator. Nothing here starts a worker."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.cluster import LocalCluster
from pdserve.config import RouterConfig, WorkerConfig
from pdserve.deployment import (
    ADAPTIVE_PREFILL_CHUNK,
    Deployment,
    HttpConfig,
    PlannerConfig,
    RayConfig,
    Topology,
    adapted,
    threads_for_cpus,
)
from pdserve.ray.pools import PoolSpec
from pdserve.serve import flags, plan
from pdserve.serve import ray as on_ray
from pdserve.sim import deploy as sim_deploy

YAML = """\
model: /models/tiny
topology: {prefill: 2, decode: 1, threads: 3}
engine: {quantization: w8g32, kv_cache_memory_gb: 0.5}
roles: {decode: {max_num_batched_tokens: 512}}
worker: {transport: ipc, kv_codec: int8}
router: {policy: round_robin}
planner: {slo_ttft_s: 1.5, slo_tpot_s: 0.1, cost_model: none, admission: false}
http: {port: 9001, served_model_name: tiny}
ray: {address: auto, cpus_per_worker: 0.5}
"""

PYTHON = Deployment(
    model="/models/tiny",
    topology=Topology(prefill=2, decode=1, threads=3),
    engine={"quantization": "w8g32", "kv_cache_memory_gb": 0.5},
    roles={"decode": {"max_num_batched_tokens": 512}},
    worker=WorkerConfig(transport="ipc", kv_codec="int8"),
    router=RouterConfig(policy="round_robin"),
    planner=PlannerConfig(slo_ttft_s=1.5, slo_tpot_s=0.1, cost_model="none", admission=False),
    http=HttpConfig(port=9001, served_model_name="tiny"),
    ray=RayConfig(cpus_per_worker=0.5),
)


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture
def yaml_file(tmp_path: Path) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(YAML)
    return path


def test_the_yaml_file_python_and_the_flags_describe_one_deployment(yaml_file: Path) -> None:
    assert Deployment.from_yaml(yaml_file) == PYTHON
    assert Deployment.from_dict(PYTHON.to_dict()) == PYTHON
    ns = serve_args(
        "/models/tiny", "--prefill", "2", "--decode", "1", "--threads", "3",
        "--quantization", "w8g32", "--kv-cache-memory-gb", "0.5", "--transport", "ipc",
        "--kv-codec", "int8", "--policy", "round_robin", "--slo-ttft", "1.5",
        "--slo-tpot", "0.1", "--cost-model", "none", "--no-admission", "--port", "9001",
        "--served-model-name", "tiny", "--ray", "--ray-cpus-per-worker", "0.5",
    )  # fmt: skip
    # the one thing flags cannot say: per-role engine overrides
    assert Deployment.from_args(ns) == dataclasses.replace(PYTHON, roles={})


def test_flags_given_beside_the_file_override_it(yaml_file: Path) -> None:
    d = flags.deployment(serve_args("--config", str(yaml_file), "--slo-ttft", "2", "--port", "1"))
    assert (d.planner.slo_ttft_s, d.planner.slo_tpot_s, d.http.port) == (2.0, 0.1, 1)
    assert d.topology == Topology(2, 1, 0, 3) and d.engine == PYTHON.engine  # the file's
    colocated = flags.deployment(serve_args("--config", str(yaml_file), "--colocated", "2"))
    assert colocated.topology.counts() == {"prefill": 0, "decode": 0, "colocated": 2}


def test_bad_deployments_name_what_to_change(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"planner: unknown keys \['slo'\]"):
        Deployment.from_dict({"planner": {"slo": 1}})
    with pytest.raises(ValueError, match=r"deployment: unknown keys \['topolgy'\]"):
        Deployment.from_dict({"topolgy": {}})
    with pytest.raises(ValueError, match="quantization must be one of"):
        Deployment.from_dict({"roles": {"decode": {"quantization": "int3"}}})
    with pytest.raises(ValueError, match="roles: 'router' is not one of"):
        Deployment(roles={"router": {}})
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        Topology(prefill=0)
    with pytest.raises(ValueError, match="not both"):
        Deployment.from_args(serve_args("--colocated", "1", "--prefill", "1"))
    with pytest.raises(ValueError, match="disaggregation must be one of"):
        PlannerConfig(disaggregation="sometimes")
    with pytest.raises(ValueError, match="cpus_per_worker must be > 0"):
        Deployment.from_args(serve_args("--ray", "--ray-cpus-per-worker", "0"))
    bad = tmp_path / "list.yaml"
    bad.write_text("- prefill\n")
    with pytest.raises(ValueError, match="mapping of sections"):
        Deployment.from_yaml(bad)


def test_serve_builds_its_workers_from_the_deployment() -> None:
    specs = plan.worker_specs(PYTHON)
    assert [(s.role, s.worker_id) for s in specs] == [
        ("prefill", "P0"),
        ("prefill", "P1"),
        ("decode", "D0"),
    ]
    assert specs[0].engine_args == {
        "threads": 3,
        "model": "/models/tiny",
        "quantization": "w8g32",
        "kv_cache_memory_gb": 0.5,
    }
    assert specs[2].engine_args["max_num_batched_tokens"] == 512  # the decode role's override
    assert {s.config for s in specs} == {PYTHON.worker}
    assert plan.cost_model(PYTHON, 3) is None  # cost_model: none, nothing needs one


def test_local_cluster_takes_a_deployment() -> None:
    """The same description, or LocalCluster's own keyword arguments made into one."""
    cluster = LocalCluster(deployment=PYTHON, name="x")
    try:
        assert cluster.counts == {"prefill": 2, "decode": 1, "colocated": 0}
        assert [s.worker_id for s in cluster.worker_specs()] == ["xP0", "xP1", "xD0"]
        assert cluster.worker_specs()[2].engine_args["max_num_batched_tokens"] == 512
    finally:
        cluster.close()
    kw = LocalCluster("m", 1, 2, threads=1, engine_args={"block_size": 8}, decode_args={"seed": 3})
    try:
        d = kw.deployment
        assert d.topology == Topology(1, 2, 0, 1) and d.router.policy == "round_robin"
        assert d.engine == {"block_size": 8} and d.roles == {"decode": {"seed": 3}}
        assert d.planner.cost_model == "none"  # a planner only through core_args, as before
    finally:
        kw.close()


def test_fractional_ray_cpus_give_one_thread_each() -> None:
    """`--ray --ray-cpus-per-worker 0.5` stopped at start: int(0.5) threads named the cost
    model file (and `threads must be >= 1, got 0`). A worker below one CPU runs one thread."""
    assert [threads_for_cpus(c) for c in (0.25, 0.5, 1.0, 1.5, 3.0)] == [1, 1, 1, 1, 3]
    d = flags.deployment(serve_args("--ray", "--ray-cpus-per-worker", "0.5"))
    spec, threads = on_ray.pool_spec(d)
    assert (spec.cpus_per_worker, threads, spec.loopback) == (0.5, 1, True)
    assert spec.engine_args["threads"] is None  # each actor decides from its own CPUs
    assert plan.cost_path(d, threads).name.endswith(".json")  # no ValueError
    assert RayConfig(address="auto").worker_cpus(2, cores=2) == 1
    assert RayConfig(address="head:6379").worker_cpus(8, cores=64) == 1


def test_pool_spec_carries_the_deployment() -> None:
    spec = PoolSpec.of(PYTHON, loopback=False)
    assert spec.engine_args["threads"] == 3 and spec.worker_config == PYTHON.worker
    assert spec.engine_for("decode")["max_num_batched_tokens"] == 512
    assert "max_num_batched_tokens" not in spec.engine_for("prefill")
    no_ray = PoolSpec.of(dataclasses.replace(PYTHON, ray=None), loopback=False)
    assert no_ray.cpus_per_worker == 1.0  # RayCluster's default before the Deployment


def test_the_simulator_takes_the_same_deployment() -> None:
    planned = dataclasses.replace(PYTHON, planner=PlannerConfig(slo_ttft_s=1.0, slo_tpot_s=0.1))
    sim = sim_deploy.Deployment.of(planned, hardware="h100", model="llama-3.1-8b", tp_decode=2)
    assert (sim.prefill, sim.decode, sim.colocated, sim.tp_decode) == (2, 1, 0, 2)
    assert (sim.slo_ttft_s, sim.slo_tpot_s) == (1.0, 0.1)
    assert sim.planner and sim.admission and sim.disaggregation == "conditional"
    assert sim.prefix_routing and sim.kv_cache_gb == 0.5
    plain = sim_deploy.Deployment.of(PYTHON, hardware="h100", model="llama-3.1-8b")
    assert not plain.planner and plain.disaggregation == "always"  # cost_model: none


def test_pdserve_sim_reads_the_deployment_file(yaml_file: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from pdserve.cli import main

    argv = ["sim", "--config", str(yaml_file), "--hardware", "h100", "--model", "llama-3.1-8b"]
    assert main([*argv, "--num-requests", "20", "--json"]) == 0
    assert '"deployment": "2P(TP1) : 1D(TP1)"' in capsys.readouterr().out
    assert main([*argv, "--prefill", "1", "--decode", "1"]) == 2
    assert "set --decode, --prefill in the deployment file" in capsys.readouterr().err


def test_speculative_config_reaches_every_worker_as_its_flag(tmp_path: Path) -> None:
    """From a YAML mapping or the serve flag, every worker's command line carries the same
    JSON, which its engine config reads back; a bad key fails at the deployment."""
    from pdserve.config import EngineConfig
    from pdserve.launcher import worker_command

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    d = Deployment(topology=Topology(prefill=1, decode=1), engine={"speculative_config": spec})
    ns = build_parser().parse_args(["serve", "--speculative-config", json.dumps(spec)])
    assert Deployment.from_args(ns).engine["speculative_config"] == json.dumps(spec)
    for s in plan.worker_specs(d):
        cmd = worker_command(s)
        value = cmd[cmd.index("--speculative-config") + 1]
        cfg = EngineConfig.from_kwargs(speculative_config=value).scheduler_config
        assert json.loads(cfg.speculative_config or "{}")["num_speculative_tokens"] == 3
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        Deployment(engine={"speculative_config": {"method": "ngram", "prompt_lookup_min": 0}})


def test_adaptive_composes_1p1d_default_slos_overflow_and_the_thread_policy() -> None:
    d = flags.deployment(serve_args("--adaptive", "--cores", "4"))
    assert d.planner.adaptive and d.topology.counts() == {"prefill": 1, "decode": 1, "colocated": 0}
    assert (d.planner.slo_ttft_s, d.planner.slo_tpot_s) == (2.0, 0.1)  # the defaults --help says
    assert d.planner.disaggregation == "overflow" and d.planner.needs_cost_model()
    assert d.topology.worker_threads() == 2  # 4 cores shared out; the policy moves them
    assert Deployment.from_dict(d.to_dict()) == d
    given = flags.deployment(serve_args("--adaptive", "--slo-ttft", "6", "--slo-tpot", "0.025"))
    assert (given.planner.slo_ttft_s, given.planner.slo_tpot_s) == (6.0, 0.025)
    policy = plan.thread_policy(d)
    assert policy.cores == 4 and policy.p_cores == 2
    twin = sim_deploy.Deployment.of(d, hardware="cpu")  # the simulator moves them too
    assert twin.cores == 4 and twin.disaggregation == "overflow" and twin.planner
    yaml = Deployment.from_dict({"planner": {"adaptive": True}, "topology": {"cores": 3}})
    assert yaml.planner.disaggregation == "overflow" and yaml.topology.host_cores() == 3


def test_adaptive_chunks_ds_prompts_and_leaves_ps_budget_to_the_thread_mover() -> None:
    d = flags.deployment(serve_args("--adaptive"))
    # stall-free sizes D's chunks beside decodes, but with none running it took a whole prompt
    # in one step, deaf to thread moves and hand-offs meanwhile
    assert d.engine_args("decode")["max_num_batched_tokens"] == ADAPTIVE_PREFILL_CHUNK
    # P keeps the shared budget: the mover caps its steps while it is short of cores
    assert "max_num_batched_tokens" not in d.engine_args("prefill")
    assert sim_deploy.Deployment.of(d, hardware="cpu").prefill_batched_tokens is None
    assert plan.thread_policy(d).grain_tokens == ADAPTIVE_PREFILL_CHUNK
    # the KV goes after each prompt: streamed, D's receive ran on the cores P computes on
    assert not d.worker.stream_kv and flags.deployment(serve_args()).worker.stream_kv
    smaller = flags.deployment(serve_args("--adaptive", "--max-num-batched-tokens", "128"))
    assert smaller.engine_args("decode")["max_num_batched_tokens"] == 128
    own = Deployment(roles={"decode": {"max_num_batched_tokens": 1024}},
                     planner=PlannerConfig(adaptive=True))  # fmt: skip
    assert own.roles["decode"]["max_num_batched_tokens"] == 1024
    assert "max_num_batched_tokens" not in flags.deployment(serve_args()).engine_args("prefill")


def test_adaptive_grain_sets_ps_step_cap_in_the_server_and_its_simulated_twin(
    tmp_path: Path,
) -> None:
    from pdserve.costmodel.model import CostModel
    from pdserve.sim.cluster import Simulation
    from pdserve.sim.deploy import build

    d = flags.deployment(serve_args("--adaptive", "--adaptive-grain", "512"))
    assert d.planner.adaptive_grain == 512 and Deployment.from_dict(d.to_dict()) == d
    assert plan.thread_policy(d).grain_tokens == 512
    assert plan.thread_policy(d).step_tokens({"P0": 1, "D0": 1}) == {"P0": 512, "D0": 512}
    cm = tmp_path / "cm.json"
    CostModel((0.1, 0.002, 0.0), (0.05, 0.001, 0.0)).save(cm, kv_bytes_per_token=100_000)
    twin = sim_deploy.Deployment.of(d, hardware="cpu", model="default", cost_model=cm)
    built = build(twin)
    assert twin.grain == 512 and built.config.thread_grain == 512
    sim = Simulation(built.config, built.step, built.link, built.planner_model, built.prefill_step)
    assert sim.thread_policy is not None and sim.thread_policy.grain_tokens == 512
    with pytest.raises(SystemExit):
        flags.deployment(serve_args("--adaptive", "--adaptive-grain", "0"))
    with pytest.raises(ValueError, match="adaptive_grain"):
        PlannerConfig(adaptive_grain=0)


@pytest.mark.parametrize(
    ("topology", "planner", "ray", "match"),
    [
        (Topology(prefill=2, decode=1), PlannerConfig(), None, "one prefill and one decode"),
        (Topology(colocated=1), PlannerConfig(), None, "one prefill and one decode"),
        (Topology(), PlannerConfig(autobalance=True), None, "autobalance"),
        (Topology(), PlannerConfig(), RayConfig(), "--ray"),
        (Topology(), PlannerConfig(cost_model="none"), None, "cost model"),
        (Topology(), PlannerConfig(stall_free=False), None, "stall-free"),
    ],
)
def test_adaptive_refuses_what_it_cannot_compose(topology, planner, ray, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        adapted(planner, topology, ray)
    with pytest.raises(ValueError, match="worker processes"):
        Deployment(planner=PlannerConfig(adaptive=True), worker=WorkerConfig(transport="inproc"))


def test_level_probe_plans_with_the_cost_model_at_the_hosts_speed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.costmodel import host_level
    from pdserve.costmodel.contention import Contention
    from pdserve.costmodel.model import CostModel

    path = tmp_path / "cm.json"
    cost = CostModel((0.01, 0.001, 0.0), (0.005, 0.001, 0.0))
    cost.save(path, kv_bytes_per_token=100)
    Contention(1.1, 1.0, 1.2, 1.0, 1, 2).save_into(path)
    asked: list[tuple[Path, int]] = []

    def measure(p: Path, model: object, threads: int, settings: dict[str, str]) -> object:
        asked.append((p, threads))
        return host_level.Level(2.0, 1.5, 1.0, 0.02, 4140, 9.0)

    monkeypatch.setattr(host_level, "measure", measure)
    off = flags.deployment(serve_args("--adaptive", "--cost-model", str(path)))
    assert not off.planner.level_probe and plan.at_host_level(off, cost, 1) == (off, cost)
    d = flags.deployment(serve_args("--adaptive", "--cost-model", str(path), "--level-probe"))
    levelled_d, levelled = plan.at_host_level(d, cost, 1)
    assert asked == [(path, 1)] and levelled == cost.rescaled(2.0, 1.5)
    saved = Path(levelled_d.planner.cost_model)
    assert saved != path and CostModel.load(saved) == levelled
    assert CostModel.load_about(saved)["level"]["prefill_x"] == 2.0
    assert Contention.load(saved) == Contention.load(path)
    # the stall-free decode worker is handed the levelled file too
    specs = plan.with_stall_free(levelled_d, plan.worker_specs(levelled_d, 1), levelled, 1)
    assert {s.config.cost_model for s in specs if s.role == "decode"} == {str(saved)}
    # and /metrics shows the level the planner runs at (1 when not probed)
    from pdserve.metrics.prometheus import Metrics
    from pdserve.serve.http import cost_level

    assert cost_level(levelled_d)["decode_x"] == 1.5 and cost_level(off) == {}
    text = Metrics().render().decode()
    assert 'pdserve_cost_model_level{kind="prefill"} 1.0' in text
    saved.unlink()
