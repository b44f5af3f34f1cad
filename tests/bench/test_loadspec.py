"""LoadSpec: `bench serve`'s flags read back into the same value code builds directly, the
workload's own settings carried along, and bad specs refused."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench.load import serve_bench
from pdserve.workloads.spec import LoadSpec, workload_defaults


def _parsed(*argv: str) -> LoadSpec:
    parser = argparse.ArgumentParser()
    serve_bench.add_arguments(parser)
    return LoadSpec.from_args(parser.parse_args(["--url", "http://x", *argv]))


def test_the_flags_defaults_are_the_specs() -> None:
    assert _parsed("--num-requests", "3", "--concurrency", "1") == LoadSpec(
        "http://x", 3, concurrency=1
    )


def test_flags_and_workload_settings_reach_the_spec() -> None:
    spec = _parsed("--num-requests", "4", "--rate", "2", "--long-fraction", "0.5", "--seed", "7")
    assert (spec.rate, spec.seed, spec.num_requests) == (2.0, 7, 4)
    assert spec.long_fraction == 0.5 and spec.short_len == workload_defaults()["short_len"]


def test_but_changes_fields_and_workload_settings_alike() -> None:
    spec = LoadSpec("http://x", 3, concurrency=1)
    wider = spec.but(num_requests=20, shift_at=None, long_fraction=0.1)
    assert wider.num_requests == 20 and wider.long_fraction == 0.1 and spec.long_fraction == 0.25
    with pytest.raises(AttributeError):
        _ = spec.no_such_setting


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_requests": 3},  # neither rate nor concurrency
        {"num_requests": 3, "rate": 1.0, "concurrency": 2},  # both
        {"num_requests": 0, "concurrency": 1},
        {"num_requests": 3, "concurrency": 1, "workload_args": {"nope": 1}},
    ],
)
def test_bad_specs_are_refused(kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError):
        LoadSpec("http://x", **kwargs)
