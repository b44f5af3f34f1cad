"""`pdserve bench spec-crossover --parts`: kernel time by part (bench/spec_crossover.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.bench.spec_crossover import _by_part


def test_kernels_are_sorted_into_matmul_attention_and_the_rest() -> None:
    row = lambda own: (1, 1, own, own, {})  # noqa: E731 - pstats' (cc, nc, tottime, cumtime, callers)
    stats = SimpleNamespace(
        stats={
            ("~", 0, "<built-in method pdserve_w8a8_vnni.matmul_q4_1_a16>"): row(0.3),
            ("~", 0, "<built-in method pdserve_w8a8_vnni.matmul_a16>"): row(0.1),
            ("~", 0, "<built-in method pdserve_paged_attention.paged_attention>"): row(0.2),
            ("llama.py", 80, "forward"): row(0.05),
        }
    )
    parts = _by_part(stats)  # type: ignore[arg-type]
    assert parts == pytest.approx({"matmul": 0.4, "attention": 0.2, "other": 0.05})


def test_attention_builds_are_timed_side_by_side(tiny_llama_path, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`--attention-builds`: a row per batch and build this CPU runs, on one engine; the
    crossover is the first build's."""
    import argparse
    import json

    from pdserve.bench import spec_crossover
    from pdserve.engine import kernels

    builds = [b for b in ("avx2", "avx512") if kernels.runs_here(b)]
    if not builds:
        pytest.skip("no paged attention kernel on this CPU")
    p = argparse.ArgumentParser()
    spec_crossover.add_arguments(p)
    out = tmp_path / "rows.json"
    args = p.parse_args(
        ["--model", str(tiny_llama_path), "--threads", "1", "--batches", "1,2", "--context",
         "40", "-k", "2", "--repeats", "2", "--attention-builds", ",".join(builds),
         "--json", str(out)]
    )  # fmt: skip
    assert spec_crossover.run(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["attention_build"]) for r in rows] == [
        (b, build) for b in (1, 2) for build in builds
    ]
    assert all(r["plain_ms"] > 0 and r["verify_ms"] > 0 for r in rows)
    assert f"attention {builds[-1]}" in capsys.readouterr().out


def test_an_unknown_build_is_refused_before_the_model_loads() -> None:
    import argparse

    from pdserve.bench import spec_crossover

    p = argparse.ArgumentParser()
    spec_crossover.add_arguments(p)
    args = p.parse_args(["--model", "/nonexistent", "--attention-builds", "avx2,sse9"])
    with pytest.raises(ValueError, match="'sse9' does not run here"):
        spec_crossover.run(args)


def test_a_runner_without_the_kernel_refuses_a_build() -> None:
    import torch

    from pdserve.engine.model_runner import ModelRunner

    cache = SimpleNamespace(block_size=16, layers=[])
    runner = ModelRunner(None, cache, torch.device("cpu"), "gather")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no paged kernel"):
        runner.use_attention_build("avx2")
