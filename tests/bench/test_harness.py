"""The shared bench harness (bench/harness/): report pieces, JSON writing, a server's lifecycle."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from pdserve.bench.harness import report, servers


def test_markdown_table_and_targets() -> None:
    assert report.markdown_table(("a", "n"), [("x", 1), ("y", 2.5)], "lr") == [
        "| a | n |",
        "|---|---:|",
        "| x | 1 |",
        "| y | 2.5 |",
    ]
    with pytest.raises(ValueError, match="columns"):
        report.markdown_table(("a", "b"), [], "l")
    targets = [report.Target("t", "3x", True), report.Target("u", "not run", None)]
    assert report.targets_table(targets)[2:] == ["| t | 3x | met |", "| u | not run | n/a |"]


def test_head_pieces() -> None:
    assert report.command_line(["bench", "x", "--name", "a b"]) == "pdserve bench x --name 'a b'"
    assert report.command_line([], "python -m m") == "python -m m"
    head = report.ReportHead("2026-01-01", "pdserve bench x", {})
    assert report.head_lines(head) == ["- date: 2026-01-01", "- command: `pdserve bench x`"]
    m = {"load_average": [1.0, 2.0, 3.0]}
    assert report.load_span(m) == "1.00/1.00"
    assert report.load_span({**m, "load_average_end": [1.5, 0, 0]}) == "1.00/1.50"
    assert report.load_text([0.5, 1, 2]) == "0.50 / 1.00 / 2.00"
    host = report.host(extra=1)
    assert {"cpu", "cores", "python", "load_average", "extra"} <= set(host)
    assert report.version_of("pytest") == pytest.__version__
    assert report.version_of("no_such_module_here") is None


def test_write_json_nulls_what_json_lacks(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "r.json"
    report.write_json(path, {"a": [float("inf"), 1.0], "b": {"c": float("nan")}}, indent=1)
    assert json.loads(path.read_text()) == {"a": [None, 1.0], "b": {"c": None}}


def test_running_server_reports_one_that_exits(tmp_path: Path) -> None:
    """A server that exits before it serves is a RuntimeError carrying its log's tail."""
    server = servers.Server(
        "broken", lambda _, port: [sys.executable, "-c", "print('no such flag'); exit(2)"]
    )
    args = argparse.Namespace(startup_timeout=30.0)
    with (
        pytest.raises(RuntimeError, match=r"exited with 2:(.|\n)*no such flag"),
        servers.running_server(server, args, tmp_path / "broken.log"),
    ):
        pass
