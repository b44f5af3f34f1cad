"""What every `pdserve bench ...` report shares: the machine, targets, writing markdown + JSON."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.hostinfo import cpu_model


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
