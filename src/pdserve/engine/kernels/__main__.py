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


def builds() -> dict[str, tuple[str, str]]:
    """Every build by its display name ("w8g32 avx512"; a kernel's only build by its name):
    (kernel, isa)."""
    return {
        name if len(spec.builds) == 1 else f"{name} {isa}": (name, isa)
        for name, spec in kernels.SPECS.items()
        for isa in spec.builds
    }


def wanted() -> list[str]:
    """The builds this CPU can run (none without AVX2; the AVX-512 ones only where torch
    reports AVX512, the VNNI one only where the CPU has AVX-512 VNNI, AMX only with AMX)."""
    return [shown for shown, (_, isa) in builds().items() if kernels.runs_here(isa)]


def main() -> int:
    names = wanted()
    if not names:
        print("no native kernels for this CPU (needs AVX2): nothing to build")
        return 0
    t0 = time.monotonic()
    code = "from pdserve.engine import kernels; kernels.load({!r}, {!r})"
    every = builds()
    procs = {n: subprocess.Popen([sys.executable, "-c", code.format(*every[n])]) for n in names}
    failed = [n for n, p in procs.items() if p.wait() != 0]
    took = time.monotonic() - t0
    if failed:
        print(f"kernel build failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"kernels ready ({', '.join(names)}) in {took:.0f} s; cache {kernels.cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
