"""The engine on CUDA in bfloat16 (issue 12, item 6). Skipped without CUDA; run by
scripts/gpu_check.sh on a GPU machine. CI never needs them."""

from __future__ import annotations

import pytest
import torch

from factories import assert_engine_idle
from pdserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 49152, (5 + 13 * i,), generator=g).tolist() for i in range(n)]


def test_cuda_bfloat16_logprobs_close_to_cpu_float32(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    cpu = LLM(str(tiny_llama_path), block_size=8, num_blocks=128)
    gpu = LLM(str(tiny_llama_path), block_size=8, num_blocks=128, device="cuda", dtype="bfloat16")
    assert gpu.engine.runner.attention == "gather"  # auto on CUDA
    assert gpu.engine.cache.layers[0][0].device.type == "cuda"
    assert gpu.engine.cache.layers[0][0].dtype == torch.bfloat16
    p = SamplingParams(max_tokens=4, temperature=0, logprobs=5)
    for a, b in zip(cpu.generate(_prompts(), p), gpu.generate(_prompts(), p), strict=True):
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        shared = set(la) & set(lb)
        assert len(shared) >= 3
        assert all(abs(la[t] - lb[t]) < 0.1 for t in shared)
    assert_engine_idle(gpu)


def test_cuda_bfloat16_chunked_prefix_cached_batch_finishes_without_leaks(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    """Chunked prompts over cached prefixes mixed with decodes, on the GPU."""
    gpu = LLM(
        str(tiny_llama_path),
        block_size=8,
        num_blocks=256,
        device="cuda",
        dtype="bfloat16",
        max_num_batched_tokens=24,
    )
    shared = _prompts(1)[0] * 3
    prompts = [shared + p for p in _prompts(5)]
    outs = gpu.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert_engine_idle(gpu)
