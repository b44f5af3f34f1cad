"""What every `pdserve bench ...` report shares: the machine, targets, writing markdown + JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve import argtypes
from pdserve.hostinfo import cpu_model

if TYPE_CHECKING:
    import torch


@dataclass
class Target:
    name: str
    measured: str
    met: bool | None  # None: not measured in this run

    @property
    def status(self) -> str:
        return "n/a" if self.met is None else ("met" if self.met else "missed")


def machine_info(threads: int, **extra: Any) -> dict[str, Any]:
    """CPU, cores, threads used, torch and python versions, load average, plus `extra`."""
    import torch

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()),
        **extra,
    }


def write_report(markdown: str, data: dict[str, Any], output: Path, json_path: Path | None) -> None:
    """Print the markdown, write it to `output`, and the JSON to `json_path` if given."""
    print(markdown)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(markdown)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=2) + "\n")


@dataclass
class ReportHead:
    """What every report opens with: when, the command that reproduces it, the machine."""

    date: str
    command: str
    machine: dict[str, Any]


def invoked_as(subcommand: str) -> str | None:
    """The invoking command line if it was `pdserve bench SUBCOMMAND ...`, else None (the
    caller then spells out an equivalent one)."""
    argv = sys.argv[1:]
    return shlex.join(["pdserve", *argv]) if argv[:2] == ["bench", subcommand] else None


def write(markdown: str, data: dict[str, Any], args: Any) -> None:
    """`write_report` to the `--output` and `--json` a bench command was given."""
    write_report(markdown, data, args.output, args.json)


# ---- timing --------------------------------------------------------------------------------------
def timed(fn: Callable[[], object], times: int = 1) -> float:
    """Wall seconds of `times` calls of `fn`, together."""
    t0 = time.perf_counter()
    for _ in range(times):
        fn()
    return time.perf_counter() - t0


def sample_times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of each of `repeats` calls of `fn`, after one warm-up call."""
    fn()
    return [timed(fn) for _ in range(repeats)]


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median of `sample_times`."""
    return statistics.median(sample_times(fn, repeats))


def measure_crc32(megabytes: int, repeats: int) -> float:
    """zlib.crc32 speed in GB/s over a random buffer (what every KV frame's checksum costs)."""
    data = os.urandom(megabytes * 10**6)
    return len(data) / median_seconds(lambda: zlib.crc32(data), repeats) / 1e9


def random_ids(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    """`n` token ids drawn uniformly from the vocabulary (prompts that never share a prefix)."""
    import torch

    ids: list[int] = torch.randint(0, vocab, (n,), generator=gen).tolist()
    return ids


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--model` and `--threads`, as every engine benchmark spells them."""
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default: SmolLM2-135M")
    parser.add_argument(
        "--threads",
        type=argtypes.positive_int,
        default=None,
        help="torch threads; default: torch's choice",
    )
