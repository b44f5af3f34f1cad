"""The host a measurement ran on: CPU model, cores, load. Shared by the cost-model profiler
(`costmodel/profile.py`) and every `pdserve bench ...` report, so neither imports the other."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float]:
    return list(os.getloadavg())
