"""Native kernels, built on first use with torch's C++ extension tooling and cached on disk.

`paged_attention.cpp` is compiled with `-O3 -mavx2 -mfma` and `w8g32.cpp` (group-wise int8
weight-only matmul, engine/quant.py) with `-O3 -mavx2 -mfma -mf16c` (never `-march=native`),
so the same code runs on both machine kinds (AVX2-only AMD EPYC, AVX-512 Xeon). A build takes
~1 minute once per source version; the result is cached under `PDSERVE_KERNEL_CACHE` (default
`~/.cache/pdserve/kernels`) and reused by every later process.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
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
    """One build directory per (source text, flags), so checkouts at two paths (worktrees, CI
    clones) sharing a cache share a build. torch's loader keeps one build.ninja per directory
    and rebuilds whenever the recorded source path differs: `build_and_load` therefore compiles
    a copy of the source kept inside the build directory, whose path is the same for all."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    return cache_dir() / f"{source.stem}-{digest}"


def build_and_load(name: str, source: Path, flags: list[str]) -> ModuleType:
    """torch's loader, behind a lock the OS releases when its holder dies.

    torch guards a build with a `lock` file it creates and removes; a build killed midway (a
    worker SIGKILLed during start-up) leaves that file, and every later process then waits on it
    forever. Under our flock no other pdserve process is building here, so a `lock` file found
    then is stale: it is removed (and said) before torch runs.
    """
    from torch.utils.cpp_extension import load

    build = build_dir(source, flags)
    build.mkdir(parents=True, exist_ok=True)
    with open(build / "pdserve.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = build / "lock"
        if stale.exists():
            log.warning("removing a stale kernel build lock left by a killed build: %s", stale)
            stale.unlink(missing_ok=True)
        copy = build / source.name
        text = source.read_bytes()
        if not copy.exists() or copy.read_bytes() != text:
            copy.write_bytes(text)
        return load(
            name=name,
            sources=[str(copy)],
            extra_cflags=flags,
            build_directory=str(build),
            verbose=False,
        )


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
            _module = build_and_load("pdserve_paged_attention", SOURCE, CFLAGS)
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
            _w8g32 = build_and_load("pdserve_w8g32", W8G32_SOURCE, W8G32_CFLAGS)
        return _w8g32


def _capability() -> str:
    import torch

    return str(torch.backends.cpu.get_cpu_capability())
