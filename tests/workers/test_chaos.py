"""A short chaos run (CI size): 2 P + 2 D under load while workers are killed, restarted,
stalled and resumed at random — nothing lost, nothing wrong, nothing leaked. Longer runs:
`pdserve chaos --duration 600` (docs/benchmarks/chaos.md)."""

from __future__ import annotations

import argparse

from pdserve import chaos
from pdserve.cluster import LocalCluster


def test_short_chaos_run_loses_nothing(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    chaos.add_arguments(parser)
    args = parser.parse_args(
        ["--duration", "40", "--fault-every", "3", "--down", "1", "--concurrency", "3",
         "--max-tokens", "16", "--seed", "1"]
    )  # fmt: skip
    args.faults = ["kill", "stall"]
    with LocalCluster(
        str(tiny_llama_path), prefill=2, decode=2, transport="tcp", threads=1,
        deadline_s=2.0, lease_s=4.0,
    ) as cluster:  # fmt: skip
        report = chaos.run_chaos(cluster, args)
    assert report["lost"] == 0, report
    assert report["wrong"] == 0, report
    assert report["errors"] == {}, report  # two of each role: every request completes
    assert report["leaked_blocks"] == 0 and report["workers_not_idle"] == [], report
    # a restart reloads the model (seconds on 2 busy cores): a few faults fit in 40 s
    assert len(report["faults"]) >= 2 and report["completed"] >= 20, report
    assert report["router"]["workers_down"] >= 2, report  # the faults were noticed...
    assert report["router"]["workers_up"] >= 2, report  # ...and the victims came back
