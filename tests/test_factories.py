"""The test helpers that guard the machine itself (factories.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from factories import eventually

# An intermediate parent: starts `sleep` under die_with_parent, says its pid, then dies at once.
PARENT = """
import subprocess, sys
sys.path.insert(0, {tests!r})
from factories import die_with_parent
child = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL, preexec_fn=die_with_parent)
print(child.pid, flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_server_started_by_a_test_dies_with_the_test_process() -> None:
    tests = os.path.dirname(__file__)
    out = subprocess.run(
        [sys.executable, "-c", PARENT.format(tests=tests)],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    child = int(out.stdout)
    eventually(lambda: not _alive(child) or None, 10.0, f"sleep {child} ends with its parent")
