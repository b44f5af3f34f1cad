"""`pdserve bench sweep-sim DIR`: a finished sweep predicted again by this simulator.

The settings come from the sweep command DIR/summary.json records (parsed by `bench sweep`'s
own flags), each system is predicted as `bench sweep --sim` does it (`sweep_sim.predict`), the
measured points stay as they are, and the report says when the prediction was made and from
which cost model: a simulator fixed later is checked against measurements it could not see,
without hours of measuring again. The level of each point's own steps is priced again from the
steps the sweep kept, with that cost model.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path
from typing import Any

from pdserve.bench import sweep, sweep_report, sweep_sim


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", type=Path, help="a `bench sweep` output folder")
    parser.add_argument(
        "--cost-model", type=Path, default=None,
        help="the profiled cost model (default: this host's, per thread count)",
    )  # fmt: skip


def sweep_args(result: dict[str, Any], folder: Path, cost_model: Path | None) -> argparse.Namespace:
    """The sweep's settings, parsed back from the command its summary records."""
    argv = shlex.split(result["command"])
    if "sweep" not in argv:
        raise ValueError(f"{folder}/summary.json: not a bench sweep command: {result['command']}")
    parser = argparse.ArgumentParser(add_help=False)
    sweep.add_arguments(parser)
    args = parser.parse_args(argv[argv.index("sweep") + 1 :])
    args.output_dir, args.cost_model = folder, cost_model or args.cost_model
    return args


def resimulate(folder: Path, cost_model: Path | None = None) -> dict[str, Any]:
    """The simulator's prediction of the sweep in `folder`, written into its summary.json,
    report.md and sweep.png beside the measured points (which are kept)."""
    path = folder / "summary.json"
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read a sweep summary ({e})") from None
    args = sweep_args(result, folder, cost_model)
    for s in result["systems"]:
        relevel(s, args, folder)
        s["sim"] = sweep_sim.predict(s["name"], args, sweep_sim.levels(s),
                                     sweep_sim.levels(s, "steps"))  # fmt: skip
    result["simulated"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    sweep_report.write(result, folder)
    return result


def relevel(system: dict[str, Any], args: argparse.Namespace, folder: Path) -> None:
    """Each run's `steps_level` priced again from the steps the sweep kept
    (`<system>/steps/rate-<r>-run<k>.json`) with this cost model and this code."""
    for p in system.get("points") or []:
        for r in p.get("runs") or []:
            kept = (
                folder
                / system["name"]
                / "steps"
                / f"{sweep.rate_name(p['rate'])}-run{r['repeat'] + 1}.json"
            )
            if kept.is_file():
                r["steps_level"] = sweep_sim.steps_level(
                    system["name"], args, json.loads(kept.read_text())
                )


def run(args: argparse.Namespace) -> int:
    result = resimulate(args.folder, args.cost_model)
    print(sweep_report.render(result))
    return 0
