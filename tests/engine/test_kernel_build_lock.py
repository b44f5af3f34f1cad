"""A kernel build killed midway must not make every later start-up wait forever."""

from __future__ import annotations

import pytest

from pdserve.engine import kernels


@pytest.mark.skipif(
    not kernels.cpu_supported(), reason="the kernels need AVX2 (both CI kinds have it)"
)
def test_a_stale_torch_build_lock_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    build = kernels.build_dir(kernels.SOURCE, kernels.CFLAGS)
    build.mkdir(parents=True)
    (build / "lock").touch()  # what a SIGKILLed build leaves behind
    module = kernels.build_and_load("pdserve_paged_attention", kernels.SOURCE, kernels.CFLAGS)
    assert hasattr(module, "__file__")
    assert not (build / "lock").exists()
