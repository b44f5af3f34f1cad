"""Kernel candidates for --quantization int8 on this CPU, interleaved so each sees the same load:
fp32, fbgemm dynamic int8 with per-token scaling (shipped), per-tensor, torch._weight_int8pack_mm.
Run: PYTHONPATH=src python scripts/quant_kernels.py (docs/benchmarks/quant.md)."""

import statistics
import time
import warnings
from collections.abc import Callable

import torch

from pdserve.engine.quant import Int8Linear

warnings.simplefilter("ignore")
K, N = 576, 3072  # the issue's [576 x 3072] weight


def _per_call(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w = torch.randn(K, N) * 0.02
    lin = Int8Linear(w)
    scales = (w.t().abs().amax(1) / 127).contiguous()
    w8 = torch.round(w.t() / scales[:, None]).to(torch.int8).contiguous()
    for rows in (1, 8, 32, 512):
        x = torch.randn(rows, K)
        fns: dict[str, Callable[[], object]] = {
            "fp32": lambda x=x: x @ w,
            "int8 fbgemm per-token (shipped)": lambda x=x: lin(x),
            "int8 fbgemm per-tensor": lambda x=x: torch.ops.quantized.linear_dynamic(
                x, lin._packed, True
            ),
            "_weight_int8pack_mm": lambda x=x: torch._weight_int8pack_mm(x, w8, scales),
        }
        n = 20 if rows < 512 else 3
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(9):  # interleaved: every kernel sees the same load
            for name, fn in fns.items():
                times[name].append(_per_call(fn, n))
        base = statistics.median(times["fp32"])
        cells = [
            f"{k} {statistics.median(v) * 1e6:.0f} us ({base / statistics.median(v):.2f}x fp32)"
            for k, v in times.items()
        ]
        print(f"M={rows}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
