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
