"""What each `bench sched` experiment is: its two arms (A with the feature, B the baseline),
its workload and topology, the `pdserve serve` command of an arm, and the `bench serve` loads
sent to it (settings, warm-up). Plain data and pure functions; `sched` runs them.

The experiments and what they measure are described in `sched`'s module docstring.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.bench.harness.servers import pdserve_bin, run_load
from pdserve.workloads.spec import LoadSpec, default

WARMUP_TOKENS = 4


@dataclass(frozen=True)
class Arm:
    name: str
    flags: tuple[str, ...]


@dataclass(frozen=True)
class Experiment:
    name: str
    workload: str
    prefill: int
    decode: int
    arms: tuple[Arm, Arm]  # A: the feature, B: the baseline
    load_factor: float  # x the measured capacity
    num_requests: int
    # bench serve settings of the workload (input_len, output_len, ...), unless given as flags
    settings: dict[str, Any] = field(default_factory=dict)


EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        Experiment(
            "admission",
            "synthetic",
            1,
            1,
            (Arm("admission", ()), Arm("no-admission", ("--no-admission",))),
            load_factor=2.0,
            num_requests=40,
            settings={"input_len": 512, "output_len": 64, "len_spread": 0.25},
        ),
        Experiment(
            "conditional",
            "mixed",
            1,
            1,
            (
                Arm("conditional", ("--disaggregation", "conditional")),
                Arm("always", ("--disaggregation", "always")),
            ),
            load_factor=1.0,
            num_requests=40,
        ),
        Experiment(
            "prefix",
            "multiturn",
            2,
            2,
            (
                Arm("prefix-routing", ("--prefix-routing",)),
                Arm("no-prefix", ("--no-prefix-routing",)),
            ),
            load_factor=1.0,
            num_requests=32,
            settings={
                "input_len": 256,
                "output_len": 32,
                "len_spread": 0.25,
                "turns": 4,
                "prompt_format": "text",
            },
        ),
        Experiment(
            "autobalance",
            "shifting",
            1,
            1,
            (Arm("autobalance", ("--autobalance",)), Arm("static", ())),
            load_factor=1.0,
            num_requests=40,
        ),
    )
}
# the bench serve settings each workload reads (generic flags and its own, WORKLOAD_ARGUMENTS)
_LENGTHS = ("input_len", "output_len", "len_spread")
WORKLOAD_KEYS: dict[str, tuple[str, ...]] = {
    "synthetic": (*_LENGTHS, "prompt_format"),
    "multiturn": (*_LENGTHS, "turns", "prompt_format", "multiturn_answers"),
    "mixed": ("short_len", "long_len", "long_fraction", "mixed_output_len", "prompt_format"),
    "shifting": (
        "phase1_input_len",
        "phase1_output_len",
        "phase2_input_len",
        "phase2_output_len",
        "shift_at",
        "shift_at_s",
        "prompt_format",
    ),
}


def topology(exp: Experiment, args: argparse.Namespace) -> tuple[int, int]:
    return (args.prefill or exp.prefill, args.decode or exp.decode)


def server_command(
    args: argparse.Namespace,
    exp: Experiment,
    port: int | str,
    arm: Arm | None,
    slo: tuple[float, float] | None,
) -> list[str]:
    """`pdserve serve` of one arm (`arm=None`, `slo=None`: the plain calibration server)."""
    p, d = topology(exp, args)
    cmd = [
        pdserve_bin(), "serve", *([str(args.model)] if args.model else []),
        "--prefill", str(p), "--decode", str(d), "--threads", str(args.threads),
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if slo is not None and (args.server_slos or exp.name == "admission"):
        cmd += ["--slo-ttft", f"{slo[0]:.6g}", "--slo-tpot", f"{slo[1]:.6g}"]
        if exp.name != "admission":
            cmd.append("--no-admission")
    if arm is not None:
        cmd += list(arm.flags)
    return cmd + shlex.split(args.pdserve_args)


def settings(args: argparse.Namespace, exp: Experiment) -> dict[str, Any]:
    """The workload's bench serve settings: flags given here, else the experiment's defaults
    (else bench serve's); only those its workload reads."""
    out: dict[str, Any] = {"workload": exp.workload}
    for key in WORKLOAD_KEYS[exp.workload]:
        given = getattr(args, key, None)
        out[key] = given if given is not None else exp.settings.get(key)
    return {k: v for k, v in out.items() if v is not None}


def bench_ns(
    args: argparse.Namespace,
    exp: Experiment,
    url: str,
    *,
    num_requests: int,
    seed: int,
    rate: float | None = None,
    concurrency: int | None = None,
    slo: tuple[float, float] | None = None,
) -> LoadSpec:
    """The load of one arm's run, with the experiment's workload settings."""
    spec = LoadSpec(
        url=url,
        workload=exp.workload,
        num_requests=num_requests,
        seed=seed,
        backend="pdserve",
        timeout=args.timeout,
        no_progress=True,
        rate=rate,
        burstiness=args.burstiness if rate is not None else default("burstiness"),
        concurrency=None if rate is not None else (concurrency or 1),
        tokenizer=str(args.model) if args.model else None,
        slo_ttft=slo[0] if slo is not None else None,
        slo_tpot=slo[1] if slo is not None else None,
    )
    return spec.but(**{k: v for k, v in settings(args, exp).items() if k != "workload"})


def warm_up(args: argparse.Namespace, exp: Experiment, url: str) -> None:
    """One short request (rejected or failed is fine: the run will show it)."""
    ns = bench_ns(args, exp, url, num_requests=1, seed=args.seed + 999).but(
        workload="synthetic",
        input_len=16,
        output_len=WARMUP_TOKENS,
        len_spread=0.0,
        prompt_format="text",
    )
    with contextlib.suppress(httpx.HTTPError, ValueError):
        run_load(ns)


def load_factor(args: argparse.Namespace, exp: Experiment) -> float:
    return float(args.load_factor) if args.load_factor is not None else exp.load_factor


def parse_experiments(text: str) -> list[str]:
    if text == "all":
        return list(EXPERIMENTS)
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown experiments {unknown}; known: {', '.join(EXPERIMENTS)}, all"
        )
    return names
