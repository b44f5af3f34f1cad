"""`--decode-matmul`: float32 projections of a few rows on the native tile kernel
(kernels/w8g32.cpp, matmul_f32) against a float64 reference, its dispatch (few rows: kernel,
more: torch's GEMM on the original weight, bit for bit), the engine's choice and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from factories import assert_engine_idle
from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine import kernels, quantize
from pdserve.engine.linear import float32, w8g32

AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
ISAS = ["avx2", pytest.param("avx512", marks=pytest.mark.skipif(not AVX512, reason="no AVX-512"))]
CPU, F32 = torch.device("cpu"), torch.float32


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("k", "n"), [(576, 960), (37, 45), (130, 16), (5, 3), (1536, 64)])
def test_tile_kernel_matches_a_float64_reference(isa: str, k: int, n: int) -> None:
    # Every row block the kernel dispatches (4-row blocks plus a 1-3 row remainder, each with
    # its own unroll), chunk edges (k % 64, k % 4) and a ragged last tile (n % 16).
    torch.manual_seed(k + n)
    w, b = torch.randn(k, n), torch.randn(n)
    ops = kernels.load("w8g32", isa)
    tiles = ops.pack_f32(w)
    assert tiles.shape == (-(-n // 16), k, 16)
    for rows in [*range(1, 10), 16, 33, 64]:
        x = torch.randn(rows, k)
        want = (x.double() @ w.double()).float()
        torch.testing.assert_close(ops.matmul_f32(x, tiles, n, None), want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(ops.matmul_f32(x, tiles, n, b), want + b, rtol=1e-5, atol=1e-4)


def test_tile_kernel_refuses_more_rows_than_it_holds() -> None:
    ops = kernels.load("w8g32")
    tiles = ops.pack_f32(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        ops.matmul_f32(torch.randn(65, 8), tiles, 16, None)


def test_tile_linear_hands_large_calls_to_torch_unchanged() -> None:
    torch.manual_seed(1)
    w, b = torch.randn(96, 50), torch.randn(50)
    lin = float32.F32TileLinear(w, b)
    assert lin.weight is w and lin.nbytes == 4 * 16 * 96 * 4 + 50 * 4
    big = torch.randn(lin.rows + 1, 96)
    assert torch.equal(lin(big), torch.addmm(b, big, w))  # prefill: exactly the untiled model
    few = torch.randn(2, 3, 96)  # leading dims kept
    torch.testing.assert_close(lin(few), few @ w + b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="features"):
        lin(torch.randn(2, 95))


def test_tile_linear_adds_a_residual_as_torch_does() -> None:
    # The layer's `x + proj(h)`: bit for bit from the kernel's store (few rows) and from
    # torch's GEMM plus an in-place add (many rows); refused for a 3-D input.
    torch.manual_seed(2)
    w, b = torch.randn(96, 50), torch.randn(50)
    lin = float32.F32TileLinear(w, b)
    for rows in (1, 5, lin.rows + 1):
        x, residual = torch.randn(rows, 96), torch.randn(rows, 60)[:, 3:53]
        assert torch.equal(lin(x, residual), residual + lin(x))
    with pytest.raises(ValueError, match="2-D"):
        lin(torch.randn(2, 3, 96), torch.randn(6, 50))


def _greedy(llm: LLM, n: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49000, (int(s),), generator=g).tolist() for s in range(3, 3 + n)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_engine_tiles_by_default_on_cpu_and_decodes_like_torch(tiny_llama_path: Path) -> None:
    tiles = LLM(str(tiny_llama_path), block_size=8, num_blocks=256)
    plain = LLM(str(tiny_llama_path), block_size=8, num_blocks=256, decode_matmul="torch")
    assert tiles.engine.decode_matmul == "tiles" and plain.engine.decode_matmul == "torch"
    layer = tiles.engine.model.layers[0]
    assert isinstance(layer.quantized["qkv"], float32.F32TileLinear)
    assert isinstance(tiles.engine.model.quantized_head, float32.F32TileLinear)
    assert plain.engine.model.layers[0].quantized == {}
    # Batched decode (8 rows a step) on the kernel, against torch's GEMM: same greedy tokens.
    assert _greedy(tiles) == _greedy(plain)
    assert tiles.engine.stats()["decode_matmul"] == "tiles"
    assert_engine_idle(tiles)
    assert_engine_idle(plain)


def test_quantized_models_keep_their_own_kernels(tiny_llama_path: Path) -> None:
    llm = LLM(str(tiny_llama_path), quantization="w8g32", prefill_format="none")
    assert llm.engine.decode_matmul == "torch"
    assert isinstance(llm.engine.model.layers[0].quantized["qkv"], w8g32.W8G32Linear)


@pytest.mark.parametrize(
    ("quantization", "device", "dtype", "why"),
    [
        ("w8g32", CPU, F32, "quantization"),
        ("none", torch.device("cuda"), F32, "device"),
        ("none", CPU, torch.bfloat16, "dtype"),
    ],
)
def test_tiles_where_they_cannot_run_is_a_start_up_error(
    quantization: str, device: torch.device, dtype: torch.dtype, why: str
) -> None:
    with pytest.raises(ValueError, match=f"decode_matmul 'tiles' cannot run with {why}"):
        quantize.decode_matmul("tiles", quantization, device, dtype)
    assert quantize.decode_matmul("auto", quantization, device, dtype) == "torch"


def test_auto_without_avx2_is_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert quantize.decode_matmul("auto", "none", CPU, F32) == "torch"
    with pytest.raises(ValueError, match="without AVX2"):
        quantize.decode_matmul("tiles", "none", CPU, F32)


def test_bad_decode_matmul_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="decode_matmul must be one of auto, tiles, torch"):
        EngineConfig.from_kwargs(decode_matmul="mkl")
    with pytest.raises(ValueError, match="decode_matmul must be one of"):
        quantize.decode_matmul("mkl", "none", CPU, F32)


def test_cost_model_records_the_decode_matmul(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.costmodel.model import CostModel, default_path
    from pdserve.costmodel.profile import _load_valid

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert default_path("/m/x.gguf", 1, host="h").name == "h-x-t1.json"
    assert (
        default_path("/m/x.gguf", 1, host="h", decode_matmul="torch").name == "h-x-mm-torch-t1.json"
    )
    model = CostModel((0.01, 1e-4, 0.0), (0.005, 1e-3, 1e-6))
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    model.save(old, threads=1, quantization="none")  # before the tile kernel: torch's GEMM
    model.save(new, threads=1, quantization="none", decode_matmul="tiles")
    assert _load_valid(old, 1, decode_matmul="tiles") is None  # another decode speed
    assert _load_valid(old, 1, decode_matmul="torch") is not None
    assert _load_valid(new, 1, decode_matmul="tiles") is not None


@pytest.mark.parametrize(("vendor", "rows"), [("GenuineIntel", 16), ("AuthenticAMD", 64)])
def test_tile_row_limit_by_vendor(monkeypatch: pytest.MonkeyPatch, vendor: str, rows: int) -> None:
    monkeypatch.setattr(kernels, "cpu_vendor", lambda: vendor)
    lin = float32.F32TileLinear(torch.randn(8, 16))
    assert lin.rows == rows
    x = torch.randn(rows + 1, 8)
    assert torch.equal(lin(x), x @ lin.weight)  # past the limit: torch's GEMM
