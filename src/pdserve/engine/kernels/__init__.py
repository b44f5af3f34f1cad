"""Native kernels, built on first use with torch's C++ extension tooling and cached on disk.

`paged_attention.cpp` is compiled with `-O3 -mavx2 -mfma` and `w8g32.cpp` (group-wise int8
weight-only matmul, engine/quant.py) with `-O3 -mavx2 -mfma -mf16c` (never `-march=native`),
so the same code runs on both machine kinds (AVX2-only AMD EPYC, AVX-512 Xeon). A build takes
~1 minute once per source version; the result is cached under `PDSERVE_KERNEL_CACHE` (default
`~/.cache/pdserve/kernels`) and reused by every later process.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from types import ModuleType

_lock = threading.Lock()
_module: ModuleType | None = None
_w8g32: ModuleType | None = None
SOURCE = Path(__file__).with_name("paged_attention.cpp")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fno-math-errno"]
W8G32_SOURCE = Path(__file__).with_name("w8g32.cpp")
W8G32_CFLAGS = [*CFLAGS, "-mf16c"]


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "pdserve" / "kernels"
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE", default))


def build_dir(source: Path, flags: list[str]) -> Path:
    """One build directory per (source text, flags): torch's loader keeps one build.ninja per
    directory and rebuilds whenever the recorded source path differs, so checkouts at two paths
    sharing a cache would rebuild each other's kernel on every start;
    keyed by content, they share."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    return cache_dir() / f"{source.stem}-{digest}"


def cpu_supported() -> bool:
    """The kernel needs AVX2 + FMA (both machine kinds have them)."""
    import torch

    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def paged_attention_module() -> ModuleType:
    """Build (once per source version) and import the CPU paged-attention extension."""
    global _module
    with _lock:
        if _module is None:
            if not cpu_supported():
                raise RuntimeError(
                    "the paged attention kernel needs a CPU with AVX2; use --attention gather"
                )
            from torch.utils.cpp_extension import load

            build = build_dir(SOURCE, CFLAGS)
            build.mkdir(parents=True, exist_ok=True)
            _module = load(
                name="pdserve_paged_attention",
                sources=[str(SOURCE)],
                extra_cflags=CFLAGS,
                build_directory=str(build),
                verbose=False,
            )
        return _module


def w8g32_module() -> ModuleType:
    """Build (once per source version) and import the group-wise int8 weight-only matmul."""
    global _w8g32
    with _lock:
        if _w8g32 is None:
            if not cpu_supported():
                raise RuntimeError(
                    "quantization 'w8g32' needs a CPU with AVX2 + FMA + F16C "
                    f"(torch reports {_capability()}); use --quantization none"
                )
            from torch.utils.cpp_extension import load

            build = build_dir(W8G32_SOURCE, W8G32_CFLAGS)
            build.mkdir(parents=True, exist_ok=True)
            _w8g32 = load(
                name="pdserve_w8g32",
                sources=[str(W8G32_SOURCE)],
                extra_cflags=W8G32_CFLAGS,
                build_directory=str(build),
                verbose=False,
            )
        return _w8g32


def _capability() -> str:
    import torch

    return str(torch.backends.cpu.get_cpu_capability())
