"""Quantized projection weights (`quantization="int8"`): accuracy against float32, the start-up
errors for what cannot run quantized, and the flag reaching every place a model loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.conftest import assert_engine_idle

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine import quantize
from pdserve.engine.linear import int8

PROMPTS = ["The capital of France is", "Once upon a time, in a land far", "1, 2, 3, 4,"]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per-row relative error (L2)."""
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def test_int8_linear_is_close_per_row_whatever_the_other_rows_scale() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 80) * 0.05  # [in, out]
    # Rows five orders of magnitude apart in one call: a per-tensor activation scale would
    # round the small rows to zero; per-token scaling keeps each row's own precision.
    x = torch.randn(6, 96) * torch.tensor([1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0])[:, None]
    lin = int8.Int8Linear(w)
    assert _rel_err(lin(x), x @ w).max() < 0.03
    assert lin.nbytes == 96 * 80 + 80 * 4  # int8 weights + one float32 scale per column


def test_int8_linear_adds_the_bias_after_rescaling() -> None:
    torch.manual_seed(1)
    w, b = torch.randn(64, 32) * 0.05, torch.randn(32)
    x = torch.randn(5, 64) * 1e-3  # tiny inputs: the output is almost only the bias
    got = int8.Int8Linear(w, b)(x)
    assert _rel_err(got, x @ w + b).max() < 1e-3
    assert got.shape == (5, 32)


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path"])
def test_int8_engine_stays_close_to_float32(fixture: str, request: pytest.FixtureRequest) -> None:
    path = str(request.getfixturevalue(fixture))
    f32 = LLM(path, block_size=8, num_blocks=64)
    q8 = LLM(path, block_size=8, num_blocks=64, quantization="int8", prefill_format="none")
    model = q8.engine.model
    assert set(model.layers[0].quantized) == set(quantize.LAYER_PROJECTIONS)
    assert model.quantized_head is not None
    assert model.layers[0].qkv.numel() == 0 and model.lm_head.numel() == 0  # float copies freed
    fp_bytes = quantize.projection_bytes(f32.engine.model)
    assert quantize.projection_bytes(model) < 0.3 * fp_bytes  # ~1/4 of float32, plus scales
    p = SamplingParams(max_tokens=4, temperature=0, logprobs=5, ignore_eos=True)
    for a, b in zip(f32.generate(PROMPTS, p), q8.generate(PROMPTS, p), strict=True):
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]  # same context: step 0
        shared = set(la) & set(lb)
        assert len(shared) >= 3
        assert all(abs(la[t] - lb[t]) < 0.05 for t in shared)
    assert q8.engine.stats()["quantization"] == "int8"
    assert_engine_idle(q8)


def test_bad_quantization_is_a_value_error_at_start_up(tiny_llama_path: Path) -> None:
    message = (
        "quantization must be one of auto, none, int8, w8g32, w8a8, gguf, gguf-a8, gguf-a16, "
        "got .int3."
    )
    with pytest.raises(ValueError, match=message):
        ModelConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(tiny_llama_path), quantization="int3")
    with pytest.raises(ValueError, match="float32"):  # no silent float fallback
        LLM(str(tiny_llama_path), quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="CPU only"):
        quantize.check_supported("int8", torch.device("cuda"), torch.float32)
    quantize.check_supported("none", torch.device("cuda"), torch.bfloat16)  # none takes anything


def test_quantization_round_trips_through_config() -> None:
    cfg = EngineConfig.from_kwargs(quantization="int8")
    assert cfg.model_config.quantization == "int8"
    assert EngineConfig().model_config.quantization == "auto"  # quantize.resolve_quantization
    # its flag on serve / worker / generate: tests/test_config.py (one test for every engine flag)


def test_cost_model_file_is_per_quantization(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.costmodel.model import default_path

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    plain = default_path("/m/x.gguf", 2, host="h")
    assert plain.name == "h-x-t2.json"  # files saved before quantization existed still apply
    assert default_path("/m/x.gguf", 2, host="h", quantization="int8").name == "h-x-int8-t2.json"
