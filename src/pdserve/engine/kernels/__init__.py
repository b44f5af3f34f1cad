"""Native kernels, built on first use with torch's C++ extension tooling and cached on disk.

`paged_attention.cpp` is compiled with `-O3 -mavx2 -mfma -mf16c` (never `-march=native`; F16C
widens a float16 KV cache as it is read), so the same code runs on both machine kinds (AVX2-only
AMD EPYC, AVX-512 Xeon). `w8g32.cpp` (group-wise int8 weight-only matmul, engine/quant.py) is
built twice from one source: `-mavx2 -mfma -mf16c` everywhere, and `-mavx512f -mavx512bw
-mavx512vl -mf16c -mfma` chosen at run time when torch reports the CPU capability AVX512
(`ATEN_CPU_CAPABILITY=avx2` forces the AVX2 build). A build takes ~1 minute once per source
version; the result is cached under `PDSERVE_KERNEL_CACHE` (default `~/.cache/pdserve/kernels`)
and reused by every later process.

`q4_1.cpp` (GGUF Q4_1 weights as the file stores them, float32 activations: `--quantization
gguf`) has w8g32's two builds and the same choice between them.

`w8a8.cpp` (int8 weights x int8 activations, one scale per 32 inputs each: `--quantization
w8a8`; GGUF Q4_1 weights x the same int8 activations: `--quantization gguf-a8`; and x int16
activations: `--quantization gguf-a16`) is built
twice too: `-mavx2 -mfma -mf16c` (vpmaddubsw) and, where the CPU has AVX-512
VNNI (its /proc/cpuinfo flag `avx512_vnni`, which torch's capability does not report), with
`-mavx512f -mavx512bw -mavx512vl -mavx512vnni` (vpdpbusd).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
_lock = threading.Lock()
_module: ModuleType | None = None
_w8g32: dict[str, ModuleType] = {}
SOURCE = Path(__file__).with_name("paged_attention.cpp")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fno-math-errno"]
ATTENTION_CFLAGS = [*CFLAGS, "-mf16c"]
W8G32_SOURCE = Path(__file__).with_name("w8g32.cpp")
W8G32_CFLAGS = [*CFLAGS, "-mf16c"]
W8G32_AVX512_CFLAGS = [*W8G32_CFLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl"]
W8G32_BUILDS = {"avx2": W8G32_CFLAGS, "avx512": W8G32_AVX512_CFLAGS}
W8A8_SOURCE = Path(__file__).with_name("w8a8.cpp")
W8A8_BUILDS = {"avx2": W8G32_CFLAGS, "vnni": [*W8G32_AVX512_CFLAGS, "-mavx512vnni"]}
_w8a8: dict[str, ModuleType] = {}
Q4_1_SOURCE = Path(__file__).with_name("q4_1.cpp")
_q4_1: dict[str, ModuleType] = {}
BF16_SOURCE = Path(__file__).with_name("bf16.cpp")  # the prefill format's element-wise ops
_bf16: dict[str, ModuleType] = {}


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "pdserve" / "kernels"
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE", default))


def headers(source: Path) -> list[Path]:
    """The shared headers beside a kernel source (common.h ...): part of every build's key
    and copied next to the source it compiles."""
    return sorted(source.parent.glob("*.h"))


def build_dir(source: Path, flags: list[str]) -> Path:
    """One build directory per (source text, headers' text, flags), so checkouts at two paths
    (worktrees, CI clones) sharing a cache share a build. torch's loader keeps one build.ninja
    per directory and rebuilds whenever the recorded source path differs: `build_and_load`
    therefore compiles a copy of the source kept inside the build directory, whose path is the
    same for all."""
    text = source.read_bytes() + b"".join(h.read_bytes() for h in headers(source))
    digest = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:12]
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
        for path in [*headers(source), source]:
            copy = build / path.name
            text = path.read_bytes()
            if not copy.exists() or copy.read_bytes() != text:
                copy.write_bytes(text)
        return load(
            name=name,
            sources=[str(build / source.name)],
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
            _module = build_and_load("pdserve_paged_attention", SOURCE, ATTENTION_CFLAGS)
        return _module


def w8g32_isa() -> str:
    """The w8g32 build this CPU runs: "avx512" where torch reports AVX512, else "avx2"."""
    return "avx512" if _capability() == "AVX512" else "avx2"


def w8g32_module(isa: str | None = None) -> ModuleType:
    """Build (once per source version and ISA) and import the group-wise int8 weight-only
    matmul; `isa` None picks by the CPU (w8g32_isa()), tests name one to compare the builds."""
    isa = isa or w8g32_isa()
    runs = isa != "avx512" or _capability() == "AVX512"
    needs = "AVX-512" if isa == "avx512" else "AVX2"
    return _isa_module("w8g32", isa, W8G32_SOURCE, W8G32_BUILDS, _w8g32, runs, needs)


def q4_1_module(isa: str | None = None) -> ModuleType:
    """Build (once per source version and ISA) and import the GGUF Q4_1 weight-only matmul
    (`--quantization gguf`); the same two builds and choice as w8g32's."""
    isa = isa or w8g32_isa()
    runs = isa != "avx512" or _capability() == "AVX512"
    needs = "AVX-512" if isa == "avx512" else "AVX2"
    return _isa_module("q4_1", isa, Q4_1_SOURCE, W8G32_BUILDS, _q4_1, runs, needs)


def bf16_module() -> ModuleType:
    """Build (once per source version) and import the prefill format's element-wise ops
    (engine/prefill_format.py); one AVX2 build for both machine kinds."""
    return _isa_module("bf16", "avx2", BF16_SOURCE, {"avx2": W8G32_CFLAGS}, _bf16, True, "AVX2")


AMX_SOURCE = Path(__file__).with_name("amx.cpp")  # the prefill format's GEMM on AMX tiles
AMX_CFLAGS = [*W8G32_AVX512_CFLAGS, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
_amx: dict[str, ModuleType] = {}


def amx_supported() -> bool:
    """The CPU has AMX bf16 tiles (and AVX-512 BF16 for the conversions around them)."""
    return {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags()


def amx_module() -> ModuleType:
    """Build (once per source version) and import the AMX GEMM (engine/prefill_format.py);
    refused where the CPU lacks AMX or Linux will not hand this process the tile state."""
    mod = _isa_module("amx", "amx", AMX_SOURCE, {"amx": AMX_CFLAGS}, _amx, amx_supported(), "AMX")
    if not mod.init():
        raise RuntimeError("Linux refused this process the AMX tile state (arch_prctl)")
    return mod


def w8a8_isa() -> str:
    """The w8a8 build this CPU runs: "vnni" where torch reports AVX512 and the CPU has AVX-512
    VNNI, else "avx2"."""
    return "vnni" if _capability() == "AVX512" and "avx512_vnni" in cpu_flags() else "avx2"


def w8a8_module(isa: str | None = None) -> ModuleType:
    """Build (once per source version and ISA) and import the int8 x int8 group-wise matmul;
    `isa` None picks by the CPU (w8a8_isa()), tests name one to compare the builds."""
    isa = isa or w8a8_isa()
    runs = isa != "vnni" or w8a8_isa() == "vnni"
    needs = "AVX-512 VNNI" if isa == "vnni" else "AVX2"
    return _isa_module("w8a8", isa, W8A8_SOURCE, W8A8_BUILDS, _w8a8, runs, needs)


def _isa_module(
    kind: str,
    isa: str,
    source: Path,
    builds: dict[str, list[str]],
    loaded: dict[str, ModuleType],
    runs_here: bool,
    needs: str,
) -> ModuleType:
    """The `isa` build of quantization `kind`'s kernel, built on first use. Refused (not built)
    where this CPU cannot run it: the build would load, then die on an illegal instruction."""
    if isa not in builds:
        raise ValueError(f"{kind} builds are {sorted(builds)}, got {isa!r}")
    with _lock:
        if isa not in loaded:
            if not cpu_supported() or not runs_here:
                raise RuntimeError(
                    f"quantization {kind!r} ({isa} build) needs a CPU with {needs} + FMA + F16C "
                    f"(torch reports {_capability()}); use --quantization none"
                )
            name = f"pdserve_{kind}" if isa == "avx2" else f"pdserve_{kind}_{isa}"
            loaded[isa] = build_and_load(name, source, builds[isa])
        return loaded[isa]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty when unknown), read once."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id ("GenuineIntel", "AuthenticAMD", ...; "" when unknown), read once."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _capability() -> str:
    import torch

    return str(torch.backends.cpu.get_cpu_capability())
