"""`pdserve bench kvpool`'s report: its rows and the one section of the page it owns."""

from __future__ import annotations

from pathlib import Path

from pdserve.bench import kvpool_bench
from pdserve.bench.harness import report


def _row(tier: str) -> kvpool_bench.Row:
    return kvpool_bench.Row(
        tier=tier, codec="none", tokens=256, blocks=16, chunk_blocks=3, chunk_mb=2.11,
        kv_mb=11.25, stored_mb=11.3, put_s=0.05, get_s=0.01, get_chunk_ms_p50=0.5,
        get_chunk_ms_p90=0.9, put_call_ms_p50=0.2, recompute_s=0.5,
    )  # fmt: skip


def _render() -> str:
    machine = {"cpu": "Xeon", "cores": 2, "threads": 1, "load_average": [1.0, 1.0, 1.0],
               "load_average_end": [2.0, 1.5, 1.0]}  # fmt: skip
    head = report.ReportHead("2026-12-01", "pdserve bench kvpool", machine)
    model = {"name": "m", "block_shape": [30, 2, 16, 3, 64], "dtype": "float32", "chunk_mb": 2.0}
    return kvpool_bench.render(head, model, [_row("memory"), _row("redis")], "/tmp")


def test_rows_show_bandwidth_and_the_speedup_over_recompute() -> None:
    page = _render()
    assert page.startswith(kvpool_bench.SECTION + "\n")
    assert "Xeon" in page and "1.00 / 1.00 / 1.00" in page and "720 KB raw" in page
    assert "chunks of C blocks" in page and "nearest 2.0 MiB" in page
    memory = next(line for line in page.splitlines() if line.startswith("| memory"))
    cells = [c.strip() for c in memory.strip("|").split("|")]
    assert cells[2:4] == ["3", "2.11"]  # C, a full chunk's stored MB
    assert cells[7] == "0.20"  # put() call ms
    assert cells[8] == f"{11.25 * (1 << 20) / 0.05 / 1e9:.2f}"  # put GB/s
    assert cells[-1] == "50.0x"  # 0.5 s recompute / 0.01 s get


def test_only_its_own_section_is_replaced(tmp_path: Path) -> None:
    page = tmp_path / "kvpool.md"
    page.write_text(
        "# KV pool\n\n## TTFT\n\nkept\n\n## Tier bandwidth\n\nold\n\n## Recovery\n\nkept too\n"
    )
    kvpool_bench._write_section(page, _render())
    text = page.read_text()
    assert "old" not in text and text.count("## Tier bandwidth") == 1
    assert "## TTFT\n\nkept" in text and text.endswith("## Recovery\n\nkept too\n")
    fresh = tmp_path / "new.md"
    kvpool_bench._write_section(fresh, _render())
    assert fresh.read_text().startswith("# KV pool benchmarks\n\n## Tier bandwidth")
