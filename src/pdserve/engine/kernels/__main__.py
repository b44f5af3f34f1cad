"""`python -m pdserve.engine.kernels`: build every native kernel this CPU runs, all at once.

Each build is one single-threaded compiler process of about a minute; built lazily they run
one after another inside whichever test or request first needs them. Here they run side by
side in separate processes (the builds are cached and locked per source and flags, so a
later process only loads them). Exits non-zero, naming the build, if one fails.
"""

from __future__ import annotations

import subprocess
import sys
import time

from pdserve.engine import kernels

BUILDS = {
    "paged_attention": "kernels.paged_attention_module()",
    "w8g32 avx2": "kernels.w8g32_module('avx2')",
    "w8g32 avx512": "kernels.w8g32_module('avx512')",
    "q4_1 avx2": "kernels.q4_1_module('avx2')",
    "q4_1 avx512": "kernels.q4_1_module('avx512')",
    "w8a8 avx2": "kernels.w8a8_module('avx2')",
    "w8a8 vnni": "kernels.w8a8_module('vnni')",
    "bf16": "kernels.bf16_module()",
    "amx": "kernels.amx_module()",
}


def wanted() -> list[str]:
    """The builds this CPU can run (none without AVX2; the AVX-512 one only where torch
    reports AVX512, the VNNI one only where the CPU has AVX-512 VNNI)."""
    if not kernels.cpu_supported():
        return []
    skip = set()
    if kernels.w8g32_isa() != "avx512":
        skip |= {"w8g32 avx512", "q4_1 avx512"}
    if kernels.w8a8_isa() != "vnni":
        skip.add("w8a8 vnni")
    if not kernels.amx_supported():
        skip.add("amx")
    return [b for b in BUILDS if b not in skip]


def main() -> int:
    names = wanted()
    if not names:
        print("no native kernels for this CPU (needs AVX2): nothing to build")
        return 0
    t0 = time.monotonic()
    code = "from pdserve.engine import kernels; {}"
    procs = {n: subprocess.Popen([sys.executable, "-c", code.format(BUILDS[n])]) for n in names}
    failed = [n for n, p in procs.items() if p.wait() != 0]
    took = time.monotonic() - t0
    if failed:
        print(f"kernel build failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"kernels ready ({', '.join(names)}) in {took:.0f} s; cache {kernels.cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
