"""A deployment to simulate (hardware, model, pools, tensor parallelism, link), run, summarized.

`Deployment` is the one description both `pdserve sim` and `pdserve plan --simulate` build;
`Deployment.of` makes it from the served one (`pdserve.deployment.Deployment`: a YAML file,
`pdserve serve`, `LocalCluster`). `simulate(deployment, requests)` runs it and `summarize`
turns the records into the numbers the bench reports: TTFT / TPOT percentiles of the served
requests, SLO attainment over *all* requests (a rejected one misses), goodput (requests meeting
both SLOs per second of the run, and per GPU), routes, rejections, utilization per pool.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pdserve import deployment as served
from pdserve.config import CacheConfig, RouterConfig
from pdserve.costmodel.contention import Contention
from pdserve.costmodel.model import CostModel
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.scheduler import SchedulerPolicy
from pdserve.percentiles import summary
from pdserve.router import slo
from pdserve.sim.closedloop import ClosedLoop
from pdserve.sim.cluster import Record, SimConfig, SimRequest, Simulation
from pdserve.sim.hardware import ModelShape, gpu, model_shape
from pdserve.sim.kv_groups import windows_from_flags
from pdserve.sim.spec import SpecModel, expected_accepted
from pdserve.sim.steptime import (
    CostModelStep,
    Link,
    RooflineStep,
    StepModel,
    gbps_to_bytes_s,
    planner_cost_model,
)

DEFAULT_LINK_GBPS_GPU = 400.0  # one 400 Gbit/s RDMA NIC per GPU


@dataclass(frozen=True)
class Deployment:
    hardware: str = "h100"
    model: str = "llama-3.1-8b"
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    tp_prefill: int = 1
    tp_decode: int = 1  # also the TP of colocated workers
    link_gbps: float | None = None  # per GPU
    per_message_s: float = 0.0005
    max_batched_tokens: int = 2048
    prefill_batched_tokens: int | None = None
    max_num_seqs: int = 256
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    planner: bool = False
    admission: bool = False
    disaggregation: str = "always"
    prefix_routing: bool = False
    autobalance: bool = False
    expected_output: int = 256
    cost_model: Path | None = None  # cpu: the profiled CostModel file
    kv_cache_gb: float = 1.0  # cpu: the engine's default KV memory
    shared_host: bool = True  # cpu: workers share this host's cores (the profiled contention)
    message_s: float = 0.0
    kv_pool: bool = False  # a KV pool every worker puts into and loads from (sim/pool.py)
    kv_pool_gb: float | None = None  # its capacity (None: unbounded)
    kv_pool_gbps: float | None = None  # its link per worker, Gbit/s (None: the P -> D link's)
    spec: SpecModel | None = None  # speculative decoding (sim/spec.py), None: off
    multiturn_reuse: bool = True  # a later turn follows the router's rule (sim/cluster.py)
    conversation_ttl_s: float = CacheConfig.conversation_ttl  # D keeps a finished turn
    conversation_local_tokens: int = RouterConfig.conversation_local_tokens
    cores: int = 0  # cpu, adaptive: the cores P and D share, threads moved (0: one thread each)
    grain: int = served.ADAPTIVE_PREFILL_CHUNK  # adaptive: P's step cap while short of cores
    # cpu: torch threads a worker runs (the cost-model file profiled at that many); 0: one, or
    # cores / 2 with adaptive
    threads: int = 0
    # the model's sliding layers over what its config says (sim/kv_groups.py
    # `windows_from_flags`): the window, and "all" or an s/f pattern of the layers
    sliding_window: int | None = None
    sliding_layers: str | None = None

    @classmethod
    def of(cls, d: served.Deployment, **sim: Any) -> Deployment:
        """The simulated twin of a served deployment (deployment.py): its pools, engine
        budgets, planner and routing; `sim` sets what only a simulation has (hardware, tensor
        parallelism, link) and may override the rest."""
        p, prefill_args = d.planner, d.roles.get("prefill", {})
        planner = p.cost_model != "none" and (p.has_slo or p.needs_cost_model())
        topology = d.topology.counts()
        derived: dict[str, Any] = {
            "prefill": topology["prefill"],
            "decode": topology["decode"],
            "colocated": topology["colocated"],
            "slo_ttft_s": p.slo_ttft_s,
            "slo_tpot_s": p.slo_tpot_s,
            "planner": planner,
            "admission": planner and p.admission and p.has_slo,
            # auto is conditional whenever the router has a cost model (serve/plan.py)
            "disaggregation": "always"
            if not planner or p.disaggregation == "always"
            else "overflow"
            if p.disaggregation == "overflow"
            else "conditional",
            "cores": d.topology.host_cores() if p.adaptive else 0,
            "grain": p.adaptive_grain,
            "threads": d.topology.threads or 0,
            "prefix_routing": planner and d.router.prefix_routing,
            "autobalance": planner and p.autobalance,
            "expected_output": p.expected_output,
            "conversation_local_tokens": d.router.conversation_local_tokens,
            **({"model": d.model} if d.model is not None else {}),
            **({"cost_model": Path(p.cost_model)} if p.cost_model not in ("auto", "none") else {}),
            **_engine_budgets(d.engine, prefill_args),
        }
        return cls(**{**derived, **sim})

    @property
    def gpus(self) -> int:
        if self.colocated:
            return self.colocated * self.tp_decode
        return self.prefill * self.tp_prefill + self.decode * self.tp_decode

    def label(self) -> str:
        if self.colocated:
            return f"{self.colocated} colocated x TP{self.tp_decode}"
        return f"{self.prefill}P(TP{self.tp_prefill}) : {self.decode}D(TP{self.tp_decode})"


def _engine_budgets(engine: dict[str, Any], prefill: dict[str, Any]) -> dict[str, Any]:
    """The simulated workers' budgets the served engine settings name (else the sim's own)."""
    names = {
        "max_num_batched_tokens": "max_batched_tokens",
        "max_num_seqs": "max_num_seqs",
        "kv_cache_memory_gb": "kv_cache_gb",
        "conversation_ttl": "conversation_ttl_s",
    }
    out = {ours: engine[theirs] for theirs, ours in names.items() if theirs in engine}
    if "max_num_batched_tokens" in prefill:
        out["prefill_batched_tokens"] = prefill["max_num_batched_tokens"]
    return out


@dataclass
class Built:
    config: SimConfig
    step: Any  # StepModel
    prefill_step: Any
    link: Link
    planner_model: CostModel | None = field(default=None)
    contention: Contention | None = None  # cpu: the workers share one host


def cost_model_path(d: Deployment) -> Path:
    """--cost-model, else the file `pdserve serve` and `bench profile --threads 1` write for
    the model with the engine's default settings (one name: `profile.profile_path`)."""
    if d.cost_model is not None:
        return Path(d.cost_model)
    from pdserve.costmodel.profile import profile_path

    # adaptive: the starting split's profile (cores / 2 a worker), the file `pdserve serve` loads
    threads = d.threads or max(1, d.cores // 2)
    return profile_path(None if d.model == "default" else d.model, threads)


def _cpu_steps(d: Deployment) -> tuple[CostModelStep, Link]:
    path = cost_model_path(d)
    if not Path(path).is_file():
        from pdserve.costmodel.profile import missing_profile

        raise ValueError(missing_profile(path))
    model = CostModel.load(Path(path))
    about = CostModel.load_about(Path(path))
    bpt = float(str(about.get("kv_bytes_per_token", 0)) or 0)
    kv_tokens = int(d.kv_cache_gb * 1024**3 // bpt) if bpt > 0 else 1 << 20
    layers = 30
    window, kinds = _cpu_windows(d)
    step = CostModelStep(model, bpt, kv_tokens, layers, sliding_window=window, layer_kinds=kinds)
    # the profiled transfer (loopback tcp, encode + decode): its bandwidth and fixed cost
    fixed, bytes_s = model.transfer
    bytes_s = gbps_to_bytes_s(d.link_gbps) if d.link_gbps else bytes_s
    return step, Link(bytes_s, fixed)


def _cpu_arch(d: Deployment) -> ModelArch:
    """The architecture of the model the cost model was profiled on (its file's `about`)."""
    from pdserve.engine import loader

    about = CostModel.load_about(Path(cost_model_path(d)))
    model = str(about.get("model") or "") or None
    return loader.load_arch(loader.resolve_model(model))


def _cpu_windows(d: Deployment) -> tuple[int | None, str]:
    """The profiled model's sliding layers as the engine's KV layout has them, with the flags
    over them."""
    import torch

    arch = _cpu_arch(d)
    layout = arch.kv_layout(torch.bfloat16)  # the dtype does not change the layer kinds
    given = (layout.window, layout.layer_kinds)
    return windows_from_flags(arch.name, arch.num_layers, given, d.sliding_window,
                              d.sliding_layers)  # fmt: skip


def _gpu_shape(d: Deployment) -> ModelShape:
    """The model's shape, its sliding layers with the flags over them."""
    shape = model_shape(d.model)
    given = (shape.sliding_window, shape.layer_kinds)
    window, kinds = windows_from_flags(shape.name, shape.layers, given, d.sliding_window,
                                       d.sliding_layers)  # fmt: skip
    return replace(shape, sliding_window=window, layer_kinds=kinds)


def build(d: Deployment) -> Built:
    if d.cores and d.hardware != "cpu":
        raise ValueError("moving threads (adaptive) is for cpu hosts")
    if d.hardware == "cpu":
        if d.tp_prefill != 1 or d.tp_decode != 1:
            raise ValueError("tensor parallelism is for GPUs; on cpu use 1")
        step: StepModel
        step, link = _cpu_steps(d)
        pstep: StepModel = step
    else:
        g, shape = gpu(d.hardware), _gpu_shape(d)
        step = RooflineStep(g, shape, d.tp_decode)
        pstep = RooflineStep(g, shape, d.tp_prefill)
        link = Link(gbps_to_bytes_s(d.link_gbps or DEFAULT_LINK_GBPS_GPU), d.per_message_s)
    policy = SchedulerPolicy(
        max_num_batched_tokens=d.max_batched_tokens, max_num_seqs=d.max_num_seqs
    )
    p_policy = None
    if d.prefill_batched_tokens is not None:
        p_policy = replace(policy, max_num_batched_tokens=d.prefill_batched_tokens)
    config = SimConfig(
        prefill=0 if d.colocated else d.prefill,
        decode=0 if d.colocated else d.decode,
        colocated=d.colocated,
        policy=policy,
        prefill_policy=p_policy,
        slo_ttft_s=d.slo_ttft_s,
        slo_tpot_s=d.slo_tpot_s,
        planner=d.planner,
        admission=d.admission,
        disaggregation=d.disaggregation,
        prefix_routing=d.prefix_routing,
        autobalance=d.autobalance,
        expected_output=d.expected_output,
        message_s=d.message_s,
        thread_cores=d.cores,
        thread_grain=d.grain,
        max_model_len=_max_model_len(d),
        spec=d.spec,
        multiturn_reuse=d.multiturn_reuse,
        conversation_ttl_s=d.conversation_ttl_s,
        conversation_local_tokens=d.conversation_local_tokens,
        **_pool_config(d, step),
    )
    planner_model = planner_cost_model(step, link=link) if d.planner else None
    contention = None
    if d.hardware == "cpu" and d.shared_host:
        contention = Contention.load(cost_model_path(d))
    return Built(config, step, pstep, link, planner_model, contention)


def _max_model_len(d: Deployment) -> int:
    """The context the served engine would hold: the model's positions (a GPU model's shape;
    on cpu, the profiled model file's architecture)."""
    if d.hardware != "cpu":
        return model_shape(d.model).max_len
    return _cpu_arch(d).max_position_embeddings


def _pool_config(d: Deployment, step: StepModel) -> dict[str, Any]:
    """SimConfig's KV pool settings: the capacity in blocks of the sim's block size."""
    if not d.kv_pool:
        return {}
    out: dict[str, Any] = {"kv_pool": True}
    if d.kv_pool_gb is not None:
        block_bytes = step.kv_bytes_per_token * SimConfig.block_size
        out["kv_pool_blocks"] = max(1, int(d.kv_pool_gb * 1e9 // block_bytes))
    if d.kv_pool_gbps is not None:
        out["kv_pool_bytes_s"] = gbps_to_bytes_s(d.kv_pool_gbps)
    return out


def simulate(
    d: Deployment,
    requests: Sequence[SimRequest],
    built: Built | None = None,
    warmup_s: float = 0.0,
    records_out: list[Record] | None = None,
    probes: Sequence[SimRequest] = (),
    load: ClosedLoop | None = None,
) -> dict[str, Any]:
    """Run and summarize; requests arriving before `warmup_s` run but are not counted.
    `records_out`, when given, receives the counted requests' records; `probes` run first,
    one at a time on the idle deployment, and only teach the planner (`probe_calibration`);
    `load`: a closed loop sends the requests instead of their arrival times."""
    b = built or build(d)
    cal = probe_calibration(b, probes)
    sim = Simulation(
        b.config, b.step, b.link, b.planner_model, b.prefill_step, b.contention, calibration=cal
    )
    records = [r for r in sim.run(requests, load=load) if r.arrival >= warmup_s]
    if records_out is not None:
        records_out.extend(records)
    out = summarize(records, d.slo_ttft_s, d.slo_tpot_s, d.gpus)
    out["deployment"] = d.label()
    out["counters"] = dict(sorted(sim.counters.items()))
    out["utilization"] = utilization(sim)
    out["preemptions"] = sum(w.sched.num_preemptions for w in sim.workers)
    if b.contention is not None:
        out["contention"] = b.contention.note
    if sim.kvpool is not None:
        out["kv_pool"] = sim.kvpool.stats(b.config.block_size)
    if d.spec is not None:
        out["speculation"] = speculation(sim, d.spec)
    if load is not None:
        out["closed_loop"] = asdict(load)
    if d.multiturn_reuse and any(r.turn > 0 for r in records):
        out["multiturn"] = multiturn(sim)
    return out


def multiturn(sim: Simulation) -> dict[str, int]:
    """Later turns prefilled on the D holding their history (reuse hits) or sent to P, D
    lacking more than --conversation-local-tokens of them (history lost), and D's kept turns
    (engine/kept_turns.py: released at their TTL or under memory pressure)."""
    out = {k: sim.counters.get(f"multiturn_{k}", 0) for k in ("reuse_hits", "history_lost")}
    for w in sim.workers:
        st = w.kv.kept.stats
        out["turns_kept"] = out.get("turns_kept", 0) + st.kept
        for why, n in st.released.items():
            out[f"kept_released_{why}"] = out.get(f"kept_released_{why}", 0) + n
    return out


def speculation(sim: Simulation, spec: SpecModel) -> dict[str, Any]:
    """Drafted and accepted tokens over the run, accepted per speculating step (and its
    expectation at full draft length: shorter near an answer's end)."""
    steps = sum(w.spec_steps for w in sim.workers)
    accepted = sum(w.spec_accepted for w in sim.workers)
    return {
        "tokens": spec.tokens,
        "acceptance": spec.acceptance,
        "draw": spec.draw,
        "paced": spec.paced,
        "steps": steps,
        "drafted": sum(w.spec_drafted for w in sim.workers),
        "accepted": accepted,
        "accepted_per_step": accepted / steps if steps else 0.0,
        "expected_per_step": expected_accepted(spec.tokens, spec.acceptance),
    }


def probe_calibration(b: Built, probes: Sequence[SimRequest]) -> slo.Calibration | None:
    """The planner's online calibration after `probes` ran one after another, each alone on
    the idle deployment, as a real router learns from requests sent before a run (the
    validation's two lone probes). None without a planner or probes."""
    if not b.config.planner or not probes:
        return None
    cal = slo.Calibration()
    for probe in probes:
        sim = Simulation(
            b.config, b.step, b.link, b.planner_model, b.prefill_step, b.contention, calibration=cal
        )
        sim.run([replace(probe, arrival=0.0)])
    return cal


def utilization(sim: Simulation) -> dict[str, float]:
    """Busy share of the run per role (summed step time over workers x run length)."""
    end = sim.now or 1.0
    out: dict[str, float] = {}
    for role in ("prefill", "decode", "colocated"):
        ws = [w for w in sim.workers if w.role == role]
        if ws:
            out[role] = round(sum(w.busy_s for w in ws) / (len(ws) * end), 4)
    return out


def meets(r: Record, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    if r.rejected is not None or r.finished_at is None:
        return False
    ttft, tpot = r.ttft, r.tpot
    ok_ttft = slo_ttft is None or (ttft is not None and ttft <= slo_ttft)
    ok_tpot = slo_tpot is None or tpot is None or tpot <= slo_tpot
    return ok_ttft and ok_tpot


def summarize(
    records: Sequence[Record], slo_ttft: float | None, slo_tpot: float | None, gpus: int
) -> dict[str, Any]:
    served = [r for r in records if r.rejected is None and r.finished_at is not None]
    ttfts = [r.ttft for r in served if r.ttft is not None]
    tpots = [r.tpot for r in served if r.tpot is not None]
    met = sum(meets(r, slo_ttft, slo_tpot) for r in records)
    start = min((r.arrival for r in records), default=0.0)
    end = max((r.finished_at or r.arrival for r in records), default=0.0)
    span = max(end - start, 1e-9)
    routes: dict[str, int] = {}
    for r in served:
        routes[r.route or "?"] = routes.get(r.route or "?", 0) + 1
    return {
        "requests": len(records),
        "served": len(served),
        "rejected": sum(r.rejected is not None for r in records),
        "unfinished": sum(r.rejected is None and r.finished_at is None for r in records),
        "ttft_s": summary(ttfts),
        "tpot_s": summary(tpots),
        "attainment": met / len(records) if records else 0.0,
        "ttft_attainment": _share(records, lambda r: slo_ttft is None or _le(r.ttft, slo_ttft)),
        "tpot_attainment": _share(
            records, lambda r: slo_tpot is None or _le(r.tpot, slo_tpot, True)
        ),
        # the share of the served prompts found cached: the workers' own prefix caches and
        # the KV pool (loaded from it: kv_pool_hit_ratio)
        "prefix_hit_ratio": sum(r.cached_tokens for r in served)
        / max(1, sum(r.prompt_len for r in served)),
        "kv_pool_hit_ratio": sum(r.pool_tokens for r in served)
        / max(1, sum(r.prompt_len for r in served)),
        "goodput_rps": met / span,
        "goodput_per_gpu": met / span / max(gpus, 1),
        "throughput_rps": len(served) / span,
        "duration_s": span,
        "gpus": gpus,
        "routes": routes,
        # a conversation's later turns, whose history may be cached (multi-turn reuse)
        "ttft_later_turns_s": summary(r.ttft for r in served if r.turn > 0 and r.ttft is not None),
    }


def _le(v: float | None, limit: float, none_ok: bool = False) -> bool:
    return none_ok if v is None else v <= limit


def _share(records: Sequence[Record], ok: Any) -> float:
    served = [r for r in records if r.rejected is None and r.finished_at is not None]
    return sum(bool(ok(r)) for r in served) / len(records) if records else 0.0


def render(s: dict[str, Any], slo_ttft: float | None, slo_tpot: float | None) -> str:
    def ms(v: float | None) -> str:
        return "—" if v is None or math.isnan(v) else f"{v * 1e3:.1f}"

    t, p = s["ttft_s"], s["tpot_s"]
    lines = [
        f"deployment: {s['deployment']} ({s['gpus']} GPU/worker slots)",
        f"requests: {s['requests']} (served {s['served']}, rejected {s['rejected']}, "
        f"unfinished {s['unfinished']}) over {s['duration_s']:.1f} s simulated",
        "",
        "| metric | p50 | p90 | p99 | mean |",
        "|---|---:|---:|---:|---:|",
        f"| TTFT ms | {ms(t['p50'])} | {ms(t['p90'])} | {ms(t['p99'])} | {ms(t['mean'])} |",
        f"| TPOT ms | {ms(p['p50'])} | {ms(p['p90'])} | {ms(p['p99'])} | {ms(p['mean'])} |",
        "",
        f"SLO attainment (TTFT <= {slo_ttft} s and TPOT <= {slo_tpot} s): "
        f"{s['attainment']:.1%} (TTFT alone {s['ttft_attainment']:.1%}, "
        f"TPOT alone {s['tpot_attainment']:.1%})",
        f"goodput: {s['goodput_rps']:.3f} req/s, {s['goodput_per_gpu']:.3f} req/s per GPU; "
        f"throughput {s['throughput_rps']:.3f} req/s",
        f"routes: {s['routes']}; utilization: {s['utilization']}; preemptions: {s['preemptions']}",
        f"prefix cache hits: {s['prefix_hit_ratio']:.1%} of served prompt tokens",
    ]
    later = s.get("ttft_later_turns_s") or {}
    if later.get("p50") is not None:
        lines.append(f"TTFT of turns 2 and later: p50 {ms(later['p50'])} ms, "
                     f"p90 {ms(later['p90'])} ms")  # fmt: skip
    if s.get("kv_pool"):
        lines.append(f"of which loaded from the KV pool: {s['kv_pool_hit_ratio']:.1%}; "
                     f"pool: {s['kv_pool']}")  # fmt: skip
    if s.get("speculation"):
        sp = s["speculation"]
        lines.append(f"speculation: {sp['tokens']} drafts per step at acceptance "
                     f"{sp['acceptance']:g} ({sp['draw']}): {sp['accepted']} of {sp['drafted']} "
                     f"drafted tokens accepted, {sp['accepted_per_step']:.2f} per step "
                     f"(expected {sp['expected_per_step']:.2f} at full length)")  # fmt: skip
    if s.get("closed_loop"):
        lines.append(ClosedLoop(**s["closed_loop"]).describe())
    if s.get("multiturn"):
        mt = s["multiturn"]
        lines.append(f"later turns: {mt['reuse_hits']} prefilled on the D holding their "
                     f"history, {mt['history_lost']} with it lost (to P); "
                     f"D kept {mt['turns_kept']} turns")  # fmt: skip
    if s["counters"]:
        lines.append(f"counters: {s['counters']}")
    if s.get("contention"):
        lines.append(s["contention"])
    return "\n".join(lines)
