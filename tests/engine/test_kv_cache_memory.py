"""The KV cache reserves its blocks at start-up but becomes resident only as they are written."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_cache import ALIGN, zeros


def _rss_mb() -> float:
    """Resident memory from the page tables (statm's counters lag behind other threads' faults)."""
    with open("/proc/self/smaps_rollup") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("Rss:"))
    return rss_kb / 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_zeros_are_zeros_aligned_and_contiguous(dtype: torch.dtype) -> None:
    t = zeros((5, 16, 3, 64), dtype, torch.device("cpu"))
    assert t.shape == (5, 16, 3, 64) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % ALIGN == 0
    assert not t.any()
    t[4, 15] = 1.0  # the last row is inside the allocation and writable
    assert int(t.count_nonzero()) == 3 * 64


def test_untouched_blocks_are_not_resident() -> None:
    before = _rss_mb()
    t = zeros((4096, 16, 4, 256), torch.float32, torch.device("cpu"))  # 256 MiB reserved
    reserved = _rss_mb()
    t[:2048].fill_(1.0)  # half the blocks written
    written = _rss_mb()
    # torch.zeros would have made all 256 MiB resident at once; here only what was written is.
    assert reserved - before < 32, (before, reserved)
    assert 100 < written - reserved < 160, (reserved, written)
    del t
