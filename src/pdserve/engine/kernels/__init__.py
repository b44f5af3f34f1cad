"""Native kernels, built on first use with torch's C++ extension tooling and cached on disk.

`SPECS` lists every kernel: its source and its builds, one per instruction set, and `load(name)`
builds (once per source version and flags) and imports the one this CPU runs. Never
`-march=native`: the same flags give the same build on both machine kinds (AVX2-only AMD EPYC,
AVX-512 Xeon), and every build has AVX2 + FMA + F16C (F16C widens fp16 scales and a float16 KV
cache as they are read).
- `bf16.cpp` (the prefill format's element-wise ops): one AVX2 build.
- `paged_attention.cpp`, `w8g32.cpp` (group-wise int8 weight-only matmul, the float32 tiles and
  the fused norm / RoPE / activation) and `q4_1.cpp` (GGUF Q4_1 weights as stored, float32
  activations): an AVX2 build and an AVX-512 one (`-mavx512f -mavx512bw -mavx512vl`), the
  latter chosen at run time when torch reports the CPU capability AVX512
  (`ATEN_CPU_CAPABILITY=avx2` forces the AVX2 build).
- `w8a8.cpp` (int8 weights x int8 activations, GGUF Q4_1 x int8 / int16 activations,
  `--quantization w8a8 | gguf-a8 | gguf-a16`): an AVX2 build (vpmaddubsw) and, where the CPU
  has AVX-512 VNNI (its /proc/cpuinfo flag `avx512_vnni`, which torch's capability does not
  report), a VNNI one (`-mavx512vnni`, vpdpbusd).
- `amx.cpp` (the prefill format's GEMM on AMX tiles): only where the CPU has AMX.
A build takes ~1 minute once per source version; the result is cached under
`PDSERVE_KERNEL_CACHE` (default `~/.cache/pdserve/kernels`) and reused by every later process.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
_lock = threading.Lock()
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fno-math-errno")
AVX2_CFLAGS = (*CFLAGS, "-mf16c")  # F16C: fp16 scales and a float16 KV cache, widened as read
AVX512_CFLAGS = (*AVX2_CFLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl")
VNNI_CFLAGS = (*AVX512_CFLAGS, "-mavx512vnni")
AMX_CFLAGS = (*AVX512_CFLAGS, "-mavx512bf16", "-mamx-tile", "-mamx-bf16")
# What each build needs of the CPU, as the refusal names it.
NEEDS = {"avx2": "AVX2", "avx512": "AVX-512", "vnni": "AVX-512 VNNI", "amx": "AMX"}


@dataclass(frozen=True)
class KernelSpec:
    """One native kernel: its source beside this module and its builds (an ISA each, named by
    it, with that ISA's compiler flags). `isa` picks the build this CPU runs when the caller
    names none (tests name one to compare builds); `refusal` is said where none runs here."""

    name: str
    source: str
    builds: Mapping[str, tuple[str, ...]]
    isa: Callable[[], str]
    refusal: str = (
        "quantization {name!r} ({isa} build) needs a CPU with {needs} + FMA + F16C "
        "(torch reports {capability}); use --quantization none"
    )

    @property
    def path(self) -> Path:
        return Path(__file__).with_name(self.source)

    def module_name(self, isa: str) -> str:
        """The extension's import name (the AVX2 build's is the bare one)."""
        return f"pdserve_{self.name}" if isa == "avx2" else f"pdserve_{self.name}_{isa}"


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "pdserve" / "kernels"
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE", default))


def headers(source: Path) -> list[Path]:
    """The shared headers beside a kernel source (common.h ...): part of every build's key
    and copied next to the source it compiles."""
    return sorted(source.parent.glob("*.h"))


def build_dir(source: Path, flags: Sequence[str]) -> Path:
    """One build directory per (source text, headers' text, flags), so checkouts at two paths
    (worktrees, CI clones) sharing a cache share a build. torch's loader keeps one build.ninja
    per directory and rebuilds whenever the recorded source path differs: `build_and_load`
    therefore compiles a copy of the source kept inside the build directory, whose path is the
    same for all."""
    text = source.read_bytes() + b"".join(h.read_bytes() for h in headers(source))
    digest = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:12]
    return cache_dir() / f"{source.stem}-{digest}"


def build_and_load(name: str, source: Path, flags: Sequence[str]) -> ModuleType:
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
            extra_cflags=list(flags),
            build_directory=str(build),
            verbose=False,
        )


def cpu_supported() -> bool:
    """The kernel needs AVX2 + FMA (both machine kinds have them)."""
    import torch

    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def w8g32_isa() -> str:
    """The w8g32 (and q4_1) build this CPU runs: "avx512" where torch reports AVX512, else
    "avx2"."""
    return "avx512" if _capability() == "AVX512" else "avx2"


def w8a8_isa() -> str:
    """The w8a8 build this CPU runs: "vnni" where torch reports AVX512 and the CPU has AVX-512
    VNNI, else "avx2"."""
    return "vnni" if _capability() == "AVX512" and "avx512_vnni" in cpu_flags() else "avx2"


def amx_supported() -> bool:
    """The CPU has AMX bf16 tiles (and AVX-512 BF16 for the conversions around them)."""
    return {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags()


def runs_here(isa: str) -> bool:
    """This CPU runs builds for `isa` (every build needs AVX2 + FMA). A build the CPU cannot
    run would load, then die on an illegal instruction."""
    if not cpu_supported():
        return False
    if isa == "avx512":
        return w8g32_isa() == "avx512"
    if isa == "vnni":
        return w8a8_isa() == "vnni"
    if isa == "amx":
        return amx_supported()
    return isa == "avx2"


SPECS = {
    spec.name: spec
    for spec in (
        KernelSpec(
            "paged_attention",
            "paged_attention.cpp",
            {"avx2": AVX2_CFLAGS, "avx512": AVX512_CFLAGS},
            w8g32_isa,
            "the paged attention kernel needs a CPU with AVX2; use --attention gather",
        ),
        # Group-wise int8 weight-only matmul (linear/w8g32.py) and the float32 tiles and
        # fused ops beside it.
        KernelSpec("w8g32", "w8g32.cpp", {"avx2": AVX2_CFLAGS, "avx512": AVX512_CFLAGS}, w8g32_isa),
        # GGUF Q4_1 weights as the file stores them, float32 activations (linear/gguf.py).
        KernelSpec("q4_1", "q4_1.cpp", {"avx2": AVX2_CFLAGS, "avx512": AVX512_CFLAGS}, w8g32_isa),
        # int8 / int16 activations against int8 or 4-bit weights (linear/w8a8.py, gguf.py).
        KernelSpec("w8a8", "w8a8.cpp", {"avx2": AVX2_CFLAGS, "vnni": VNNI_CFLAGS}, w8a8_isa),
        # The prefill format's element-wise ops (linear/bf16.py): one AVX2 build everywhere.
        KernelSpec("bf16", "bf16.cpp", {"avx2": AVX2_CFLAGS}, lambda: "avx2"),
        # The prefill format's GEMM and attention on AMX tiles (linear/bf16.py).
        KernelSpec("amx", "amx.cpp", {"amx": AMX_CFLAGS}, lambda: "amx"),
    )
}
_loaded: dict[tuple[str, str], ModuleType] = {}  # (kernel, build) -> its imported extension


def load(name: str, isa: str | None = None) -> ModuleType:
    """Build (once per source version and ISA) and import kernel `name` (a SPECS key); `isa`
    None picks the build by the CPU. Refused (not built) where this CPU cannot run it."""
    spec = SPECS[name]
    isa = isa or spec.isa()
    if isa not in spec.builds:
        raise ValueError(f"{name} builds are {sorted(spec.builds)}, got {isa!r}")
    with _lock:
        if (name, isa) not in _loaded:
            if not runs_here(isa):
                raise RuntimeError(_refusal(spec, isa))
            flags = list(spec.builds[isa])
            _loaded[(name, isa)] = build_and_load(spec.module_name(isa), spec.path, flags)
        module = _loaded[(name, isa)]
    if name == "amx" and not module.init():  # asked on every load, as the tile state is
        raise RuntimeError("Linux refused this process the AMX tile state (arch_prctl)")
    return module


def _refusal(spec: KernelSpec, isa: str) -> str:
    needs = NEEDS[isa]
    return spec.refusal.format(name=spec.name, isa=isa, needs=needs, capability=_capability())


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
