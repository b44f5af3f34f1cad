"""The parts every bench report is made of: its head (when, the command that reproduces it, the
machine it ran on), markdown tables, targets met or missed, and writing markdown and JSON.

Machine descriptions are dicts (they go into the JSON as they are): `host()` for a bench that
only drives servers (no torch in this process), `machine_info()` for one that measures in
process (adds torch and its thread count). Both carry "load_average" at the start; a bench
that runs long adds "load_average_end" (`load_average()`) when it finishes, because a shared
machine's load explains noisy numbers.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.hostinfo import cpu_model, load_average  # load_average: also a report's end


# ---- the head of a report -----------------------------------------------------------------------
@dataclass
class ReportHead:
    """What every report opens with: when, the command that reproduces it, the machine."""

    date: str
    command: str
    machine: dict[str, Any]


def host(**extra: Any) -> dict[str, Any]:
    """CPU model, cores, python version and load average now, plus `extra`."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "load_average": load_average(),
        **extra,
    }


def machine_info(threads: int, **extra: Any) -> dict[str, Any]:
    """CPU, cores, threads used, torch and python versions, load average, plus `extra`."""
    import torch

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": load_average(),
        **extra,
    }


def version_of(module: str) -> str | None:
    """`module.__version__` (a peer a report names: transformers, llama_cpp), None when it is
    not installed."""
    import importlib

    try:
        return str(importlib.import_module(module).__version__)
    except ImportError:
        return None


def now() -> str:
    """The local time, ISO 8601 to the second with its UTC offset: a report's date."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def git_head() -> str | None:
    """The checkout's commit (read-only `git rev-parse`), or None outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def invoked_as(subcommand: str) -> str | None:
    """The invoking command line if it was `pdserve bench SUBCOMMAND ...`, else None (the
    caller then spells out an equivalent one)."""
    argv = sys.argv[1:]
    return shlex.join(["pdserve", *argv]) if argv[:2] == ["bench", subcommand] else None


def command_line(argv: Sequence[str] | None, prog: str = "pdserve") -> str:
    """`prog` and the arguments it ran with (`argv`, default this process's): a report's
    command, quoted so that it pastes back into a shell."""
    return f"{prog} {shlex.join(list(argv) if argv is not None else sys.argv[1:])}".rstrip()


def head_lines(head: ReportHead) -> list[str]:
    """The date and command bullets a report's head starts with."""
    return [f"- date: {head.date}", f"- command: `{head.command}`"]


def load_text(load: Sequence[float]) -> str:
    """A load average as reports print it: "0.52 / 0.61 / 0.70" (1, 5, 15 minutes)."""
    return " / ".join(f"{x:.2f}" for x in load)


def load_span(machine: dict[str, Any]) -> str:
    """The 1-minute load average at the start / at the end ("1.52/2.03")."""
    start = machine["load_average"]
    return f"{start[0]:.2f}/{machine.get('load_average_end', start)[0]:.2f}"


# ---- tables -------------------------------------------------------------------------------------
def markdown_table(
    header: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None
) -> list[str]:
    """A markdown table's lines: `align` has one letter per column, "l" (the default) or "r"
    (numbers, `---:`)."""
    align = align or "l" * len(header)
    if len(align) != len(header):
        raise ValueError(f"align {align!r} has {len(align)} columns, the header {len(header)}")
    rule = "".join("---:|" if a == "r" else "---|" for a in align)
    lines = ["| " + " | ".join(header) + " |", "|" + rule]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


@dataclass
class Target:
    name: str
    measured: str
    met: bool | None  # None: not measured in this run

    @property
    def status(self) -> str:
        return "n/a" if self.met is None else ("met" if self.met else "missed")


def targets_table(targets: Iterable[Target]) -> list[str]:
    return markdown_table(
        ("target", "measured", "status"), ((t.name, t.measured, t.status) for t in targets)
    )


def log(msg: str, who: str = "bench") -> None:
    """A progress line on stderr (stdout carries the report), "[bench] msg"."""
    print(f"[{who}] {msg}", file=sys.stderr, flush=True)


# ---- writing ------------------------------------------------------------------------------------
def json_safe(obj: Any) -> Any:
    """`obj` with every inf and NaN as None (JSON has neither)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: Path, data: Any, indent: int = 2) -> None:
    """`data` (inf and NaN as null) as JSON at `path`, its folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(data), indent=indent) + "\n")


def write_report(markdown: str, data: dict[str, Any], output: Path, json_path: Path | None) -> None:
    """Print the markdown, write it to `output`, and the JSON to `json_path` if given."""
    print(markdown)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(markdown)
    if json_path:
        write_json(json_path, data)


def write(markdown: str, data: dict[str, Any], args: Any) -> None:
    """`write_report` to the `--output` and `--json` a bench command was given."""
    write_report(markdown, data, args.output, args.json)
