"""Plots of a bench report: matplotlib on its file-only backend (a bench runs on machines with
no display), and a figure saved at one resolution and closed (a run draws many)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DPI = 110


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported here: a bench that draws nothing never
    pays for matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> None:
    """Lay out, write as PNG at `DPI` and free the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
