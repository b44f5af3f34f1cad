"""Kernel candidates for --quantization int8 on this CPU, interleaved so each sees the same load:
fp32, fbgemm dynamic int8 with per-token scaling (shipped), per-tensor, torch._weight_int8pack_mm.
Run: PYTHONPATH=src python scripts/quant_kernels.py (docs/benchmarks/quant.md)."""

import torch, time, statistics, sys, warnings

warnings.simplefilter("ignore")
from pdserve.engine.quant import Int8Linear

torch.set_num_threads(1)
torch.manual_seed(0)
K, N = 576, 3072
W = torch.randn(K, N) * 0.02
lin = Int8Linear(W)
w8 = torch.round(W.t() / (W.t().abs().amax(1, keepdim=True) / 127)).to(torch.int8).contiguous()
sc = (W.t().abs().amax(1) / 127).contiguous()


def one(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


for M in (1, 8, 32, 512):
    x = torch.randn(M, K)
    n = 20 if M < 512 else 3
    fns = {
        "fp32": lambda: x @ W,
        "int8 fbgemm per-token (shipped)": lambda: lin(x),
        "int8 fbgemm per-tensor": lambda: torch.ops.quantized.linear_dynamic(x, lin._packed, True),
        "_weight_int8pack_mm": lambda: torch._weight_int8pack_mm(x, w8, sc),
    }
    for f in fns.values():
        f()
    t = {k: [] for k in fns}
    for _ in range(9):  # interleaved: every kernel sees the same load
        for k, f in fns.items():
            t[k].append(one(f, n))
    base = statistics.median(t["fp32"])
    print(
        f"M={M}: "
        + "; ".join(
            f"{k} {statistics.median(v) * 1e6:.0f} us ({base / statistics.median(v):.2f}x fp32)"
            for k, v in t.items()
        ),
        flush=True,
    )
