"""`quantization="w8a8"`: the integer kernel against a reference computed in Python (weights
and activations quantized per 32 inputs, products summed in float64), both builds bit for bit
where the CPU has VNNI, the tiny models' greedy agreement with float32, and the build choice."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_engine_idle
from tests.engine.test_quant_w8g32 import PROMPTS, _reference

from factories import greedy_agreement
from pdserve import LLM, SamplingParams
from pdserve.engine import kernels, quantize
from pdserve.engine.linear import w8a8, w8g32

VNNI = kernels.cpu_supported() and kernels.w8a8_isa() == "vnni"
ISAS = ["avx2", pytest.param("vnni", marks=pytest.mark.skipif(not VNNI, reason="no AVX-512 VNNI"))]


def _codes(x: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the kernel quantizes it: per row, per group of 32 inputs, int8 codes
    against max-abs / 127 (round half to even, as nearbyint), as float [M, G, 32], and amax
    [M, G, 1]."""
    m, k = x.shape
    xp = torch.nn.functional.pad(x, (0, -k % group)).view(m, -1, group)
    amax = xp.abs().amax(dim=-1, keepdim=True)
    # torch.full_like(...) / amax, not 127 / amax: the latter is amax.reciprocal() * 127,
    # which rounds differently from the kernel's one division.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xp * inv).clamp(-127, 127), amax


def _quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] quantized as the kernel does, back to float."""
    q, amax = _codes(x)
    return (q * (amax / 127)).view(x.shape[0], -1)[:, : x.shape[1]]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("k", "n"), [(576, 96), (70, 33), (100, 16), (31, 200), (64, 48)])
def test_w8a8_kernel_matches_the_quantized_reference(isa: str, k: int, n: int) -> None:
    # Every row block the kernel dispatches (1..kRows and a remainder), ragged groups (k % 32)
    # and tiles (n % 16), with and without bias.
    torch.manual_seed(k * 7 + n)
    w, b = torch.randn(k, n) * 0.05, torch.randn(n)
    ref_w = _reference(w).double()
    for bias in (None, b):
        lin = w8a8.W8A8Linear(w, bias, isa=isa)
        assert lin._ops.isa == isa
        torch.testing.assert_close(lin.dequantized(), ref_w.float(), rtol=0, atol=1e-6)
        for rows in (1, 2, 3, 4, 5, 8, 9, 17, 40):
            x = torch.randn(rows, k) * 3
            want = _quantized_rows(x).double() @ ref_w
            if bias is not None:
                want = want + bias.double()
            torch.testing.assert_close(lin(x).double(), want, rtol=1e-5, atol=1e-4)
    groups, tiles = -(-k // 32), -(-n // 16)
    assert lin.nbytes == tiles * 16 * groups * 32 + tiles * groups * 16 * 2 + n * 4


@pytest.mark.parametrize("isa", ISAS)
def test_w8a8_residual_is_added_as_torch_adds_it(isa: str) -> None:
    torch.manual_seed(12)
    w, b = torch.randn(70, 40) * 0.05, torch.randn(40)
    lin = w8a8.W8A8Linear(w, b, isa=isa)
    for rows in (1, 9):
        x = torch.randn(rows, 70)
        residual = torch.randn(rows, 50)[:, 5:45]  # strided rows
        assert torch.equal(lin(x, residual), residual + lin(x))
    with pytest.raises(RuntimeError, match="residual"):
        lin(torch.randn(2, 70), torch.randn(2, 41))


def test_w8a8_activation_quantization_matches_python() -> None:
    # 70 inputs: two whole groups (the vector path) and a ragged one (the scalar path).
    torch.manual_seed(1)
    x = torch.randn(5, 70) * torch.logspace(-3, 2, 70)  # groups of very different scales
    x[2] = 0  # an all-zero row: scale 0, every code 0
    x[3, 0], x[3, 1:32] = 127.0, torch.arange(31) - 15.5  # scale 1, every code a tie (to even)
    ops = kernels.load("w8a8", "avx2")
    q, s = ops.quantize_activations(x)
    codes, amax = _codes(x)
    assert torch.equal(q.float(), codes.view(5, 96))  # every code exact
    assert torch.equal(s, (amax / 127).view(5, 3))
    assert q.dtype == torch.int8 and q.shape == (5, 96) and s.shape == (5, 3)
    assert int(q.abs().max()) <= 127 and torch.all(q[:, 70:] == 0)
    back = (q.float().view(5, 3, 32) * s[:, :, None]).view(5, 96)[:, :70]
    torch.testing.assert_close(back, _quantized_rows(x), rtol=1e-6, atol=1e-7)
    assert torch.all(s[2] == 0)


@pytest.mark.skipif(not VNNI, reason="needs a CPU with AVX-512 VNNI")
def test_w8a8_vnni_and_avx2_builds_agree_bit_for_bit() -> None:
    # Both sum each group's products exactly in int32, then run the same float operations.
    torch.manual_seed(3)
    w, b = torch.randn(200, 90) * 0.05, torch.randn(90)
    a2, vn = w8a8.W8A8Linear(w, b, isa="avx2"), w8a8.W8A8Linear(w, b, isa="vnni")
    assert a2._ops.rows == 4 and vn._ops.rows == 8
    # One packed layout; the VNNI build's bytes are the codes + 128 (unsigned operand).
    assert a2._ops.weight_offset == 0 and vn._ops.weight_offset == 128
    assert torch.equal(a2.q, vn.q ^ -128) and torch.equal(a2.scales, vn.scales)
    assert torch.equal(a2.dequantized(), vn.dequantized())
    for rows in (1, 7, 8, 11, 33):
        x = torch.randn(rows, 200)
        assert torch.equal(a2(x), vn(x))


def test_w8a8_build_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = (
        ("AVX512", {"avx512_vnni"}, "vnni"),
        ("AVX512", set(), "avx2"),  # AVX-512 without VNNI (Skylake-SP)
        ("AVX2", {"avx512_vnni"}, "avx2"),  # torch held to AVX2 (ATEN_CPU_CAPABILITY=avx2)
    )
    for reported, flags, isa in cases:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda r=reported: r)
        monkeypatch.setattr(kernels, "cpu_flags", lambda f=flags: frozenset(f))
        assert kernels.w8a8_isa() == isa
    # Where the CPU has no VNNI the VNNI build is refused, not run (an illegal instruction).
    monkeypatch.setattr(kernels, "_loaded", {})
    with pytest.raises(RuntimeError, match="vnni build"):
        kernels.load("w8a8", "vnni")
    with pytest.raises(ValueError, match="builds are"):
        kernels.load("w8a8", "avx512")


def test_w8a8_rejects_a_wrong_input_width() -> None:
    lin = w8a8.W8A8Linear(torch.randn(64, 32))
    with pytest.raises(ValueError, match="takes 64"):
        lin(torch.randn(2, 63))


def test_quantized_projections_take_any_leading_shape() -> None:
    # The layers pass float32 [rows, in] straight to the kernel; other shapes and dtypes go
    # through the reshaping path and give the same rows.
    torch.manual_seed(4)
    w = torch.randn(64, 48) * 0.05
    x = torch.randn(6, 64)
    for lin in (w8a8.W8A8Linear(w), w8g32.W8G32Linear(w)):
        flat = lin(x)
        assert flat.shape == (6, 48)
        assert torch.equal(lin(x.view(2, 3, 64)), flat.view(2, 3, 48))
        assert torch.equal(lin(x.double()), flat)


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path"])
def test_w8a8_engine_agrees_with_float32(fixture: str, request: pytest.FixtureRequest) -> None:
    path = str(request.getfixturevalue(fixture))
    f32 = LLM(path, block_size=8, num_blocks=64)
    w8 = LLM(path, block_size=8, num_blocks=64, quantization="w8a8", prefill_format="none")
    model = w8.engine.model
    kinds = {name: type(p) for name, p in model.layers[0].quantized.items()}
    # q|k|v keeps float32 activations (quantize.W8A8_FLOAT_ACTIVATIONS), the rest run int8 x int8.
    assert kinds == {"qkv": w8g32.W8G32Linear, "o": w8a8.W8A8Linear,
                     "gate_up": w8a8.W8A8Linear, "down": w8a8.W8A8Linear}  # fmt: skip
    assert isinstance(model.quantized_head, w8a8.W8A8Linear)
    assert model.layers[0].qkv.numel() == 0 and model.lm_head.numel() == 0  # float copies freed
    assert model.fused is not None  # the native RMSNorm / RoPE, as w8g32
    assert quantize.projection_bytes(model) < 0.32 * quantize.projection_bytes(f32.engine.model)
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in f32.generate(PROMPTS, p)]
    got = [o.outputs[0].token_ids for o in w8.generate(PROMPTS, p)]
    # Random tiny weights have flat logits (near ties), so this is looser than the real model.
    assert greedy_agreement(ref, got) >= 0.6
    assert w8.engine.stats()["quantization"] == "w8a8"
    assert_engine_idle(w8)


def test_make_kernels_builds_what_this_cpu_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.engine.kernels import __main__ as build_all

    monkeypatch.setattr(kernels, "cpu_supported", lambda: True)
    for w8g32_isa, w8a8_isa, amx, skipped in (
        ("avx512", "vnni", True, set()),
        ("avx512", "vnni", False, {"amx"}),  # an AVX-512 Xeon whose hypervisor hides AMX
        ("avx512", "avx2", False, {"w8a8 vnni", "amx"}),
        (
            "avx2",
            "avx2",
            False,
            {"paged_attention avx512", "w8g32 avx512", "q4_1 avx512", "w8a8 vnni", "amx"},
        ),
    ):
        monkeypatch.setattr(kernels, "w8g32_isa", lambda i=w8g32_isa: i)
        monkeypatch.setattr(kernels, "w8a8_isa", lambda i=w8a8_isa: i)
        monkeypatch.setattr(kernels, "amx_supported", lambda a=amx: a)
        assert set(build_all.wanted()) == set(build_all.builds()) - skipped
    monkeypatch.setattr(kernels, "cpu_supported", lambda: False)
    assert build_all.wanted() == []
