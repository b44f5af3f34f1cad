"""A kernel build killed midway must not make every later start-up wait forever."""

from __future__ import annotations

import types

import torch.utils.cpp_extension

from pdserve.engine import kernels


def test_a_stale_torch_build_lock_is_removed_before_torch_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    build = kernels.build_dir(kernels.SPECS["paged_attention"].path, kernels.CFLAGS)
    build.mkdir(parents=True)
    (build / "lock").touch()  # what a SIGKILLed build leaves behind: torch would wait forever
    seen = {}

    def fake_load(name, sources, extra_cflags, build_directory, verbose):  # type: ignore[no-untyped-def]
        seen["lock_left"] = (build / "lock").exists()
        seen["dir"] = build_directory
        return types.SimpleNamespace(name=name)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    module = kernels.build_and_load(
        "pdserve_paged_attention", kernels.SPECS["paged_attention"].path, kernels.CFLAGS
    )
    assert module.name == "pdserve_paged_attention"
    assert seen == {"lock_left": False, "dir": str(build)}


def test_build_dirs_are_keyed_by_source_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    a = kernels.build_dir(kernels.SPECS["paged_attention"].path, kernels.CFLAGS)
    assert a == kernels.build_dir(kernels.SPECS["paged_attention"].path, list(kernels.CFLAGS))
    assert a != kernels.build_dir(kernels.SPECS["paged_attention"].path, [*kernels.CFLAGS, "-DX"])
    assert a != kernels.build_dir(kernels.SPECS["w8g32"].path, kernels.CFLAGS)


def test_build_dirs_are_keyed_by_the_shared_headers_too(tmp_path, monkeypatch):
    # A kernel that includes common.h must rebuild when only the header changes.
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.cpp").write_text('#include "common.h"\n')
    (src / "common.h").write_text("// one\n")
    before = kernels.build_dir(src / "k.cpp", kernels.CFLAGS)
    (src / "common.h").write_text("// two\n")
    assert kernels.build_dir(src / "k.cpp", kernels.CFLAGS) != before
    assert [h.name for h in kernels.headers(kernels.SPECS["paged_attention"].path)] == ["common.h"]
