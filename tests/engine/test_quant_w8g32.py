"""`quantization="w8g32"`: the C++ kernel against a dequantized reference (decode and prefill
paths, odd shapes, bias), the tiny models' greedy agreement with float32, and the start-up
error on a CPU the kernel cannot run on."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_engine_idle

from factories import greedy_agreement
from pdserve import LLM, SamplingParams
from pdserve.engine import kernels, quantize
from pdserve.engine.linear import base, w8g32

PROMPTS = ["The capital of France is", "Once upon a time, in a land far", "1, 2, 3, 4,"]


def _reference(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Group-wise int8 dequantization of [in, out] computed in Python: one scale per `group`
    inputs per output column, scales rounded to fp16 as the kernel stores them."""
    k, n = w.shape
    pad = -k % group
    wp = torch.cat([w, w.new_zeros(pad, n)]) if pad else w
    blocks = wp.reshape(-1, group, n)
    scale = (blocks.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-7).half().float()
    q = torch.round(blocks / scale).clamp(-127, 127)
    return (q * scale).reshape(-1, n)[:k]


@pytest.mark.parametrize(("k", "n"), [(64, 48), (96, 160), (33, 17), (70, 5)])
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_w8g32_kernel_matches_the_dequantized_reference(k: int, n: int, rows: int) -> None:
    torch.manual_seed(k * 1000 + n + rows)
    w, b = torch.randn(k, n) * 0.05, torch.randn(n)
    ref_w = _reference(w)
    for bias in (None, b):
        lin = w8g32.W8G32Linear(w, bias)
        torch.testing.assert_close(lin.dequantized(), ref_w, rtol=0, atol=1e-6)
        x = torch.randn(rows, k)
        want = x @ ref_w if bias is None else x @ ref_w + bias
        # rows <= 16 run the streaming kernel, more rows the dequantize + GEMM path.
        torch.testing.assert_close(lin(x), want, rtol=1e-4, atol=1e-4)
    groups, tiles = -(-k // 32), -(-n // 16)
    assert lin.nbytes == tiles * 16 * k + tiles * groups * 16 * 2 + n * 4  # int8, fp16, bias


AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
ISAS = ["avx2", pytest.param("avx512", marks=pytest.mark.skipif(not AVX512, reason="no AVX-512"))]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("k", "n"), [(576, 1536), (70, 33), (100, 16), (31, 200)])
def test_w8g32_builds_match_the_reference_on_ragged_shapes(isa: str, k: int, n: int) -> None:
    # Every row count the streaming kernel dispatches (1..16: kRows blocks plus a remainder,
    # each with its own input unroll), ragged groups (k % 32) and tiles (n % 16).
    torch.manual_seed(k + n)
    w, b = torch.randn(k, n) * 0.05, torch.randn(n)
    lin = w8g32.W8G32Linear(w, b, isa=isa)
    ref_w = _reference(w)
    for rows in range(1, base.W8G32_GEMV_ROWS + 1):
        x = torch.randn(rows, k)
        torch.testing.assert_close(lin(x), x @ ref_w + b, rtol=1e-4, atol=2e-4)


@pytest.mark.skipif(not AVX512, reason="needs a CPU where torch reports AVX512")
def test_w8g32_avx512_and_avx2_builds_agree() -> None:
    torch.manual_seed(3)
    w = torch.randn(200, 90) * 0.05
    a2, a5 = w8g32.W8G32Linear(w, isa="avx2"), w8g32.W8G32Linear(w, isa="avx512")
    assert a2._ops.isa == "avx2" and a5._ops.isa == "avx512"
    assert a5._ops.rows == 8 and a2._ops.rows == 4
    assert torch.equal(a2.q, a5.q) and torch.equal(a2.scales, a5.scales)  # one packed layout
    x = torch.randn(11, 200)
    torch.testing.assert_close(a5(x), a2(x), rtol=1e-5, atol=1e-5)


def test_w8g32_build_follows_the_cpu_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    for reported, isa in (("AVX512", "avx512"), ("AVX2", "avx2")):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda r=reported: r)
        assert kernels.w8g32_isa() == isa
    # On an AVX2 CPU the AVX-512 build is refused, not run (it would die on an illegal
    # instruction); the default then is the AVX2 build.
    monkeypatch.setattr(kernels, "_loaded", {})
    with pytest.raises(RuntimeError, match="avx512 build"):
        kernels.load("w8g32", "avx512")
    with pytest.raises(ValueError, match="builds are"):
        kernels.load("w8g32", "sse")
    assert w8g32.W8G32Linear(torch.randn(32, 16))._ops.isa == "avx2"


def test_w8g32_prefill_in_column_chunks_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    # The LM head is dequantized chunk by chunk; force chunking on a small matrix.
    monkeypatch.setattr(w8g32, "W8G32_SCRATCH", 64 * 48)
    monkeypatch.setattr(base, "gemv_rows", lambda isa: 16)  # 40 rows: the prefill path
    torch.manual_seed(5)
    w, b = torch.randn(64, 200) * 0.05, torch.randn(200)
    lin = w8g32.W8G32Linear(w, b)
    assert lin._chunk < 200
    x = torch.randn(40, 64)
    torch.testing.assert_close(lin(x), x @ _reference(w) + b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("vendor", "isa", "rows"), [
    ("GenuineIntel", "avx2", 64), ("GenuineIntel", "avx512", 64),
    ("AuthenticAMD", "avx2", 64), ("AuthenticAMD", "avx512", 1 << 62), ("", "avx2", 64),
])  # fmt: skip
def test_w8g32_kernel_row_limit_by_vendor(
    monkeypatch: pytest.MonkeyPatch, vendor: str, isa: str, rows: int
) -> None:
    monkeypatch.setattr(kernels, "cpu_vendor", lambda: vendor)
    assert base.gemv_rows(isa) == rows


def test_w8g32_many_rows_on_the_kernel_match_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A prompt chunk of 100 rows through the streaming kernel (no limit, as on an AMD EPYC).
    monkeypatch.setattr(base, "gemv_rows", lambda isa: 1 << 62)
    torch.manual_seed(6)
    w, b = torch.randn(96, 70) * 0.05, torch.randn(70)
    lin = w8g32.W8G32Linear(w, b)
    x = torch.randn(100, 96)
    torch.testing.assert_close(lin(x), x @ _reference(w) + b, rtol=1e-4, atol=2e-4)


def test_w8g32_rejects_a_wrong_input_width() -> None:
    lin = w8g32.W8G32Linear(torch.randn(64, 32))
    with pytest.raises(ValueError, match="takes 64"):
        lin(torch.randn(2, 63))


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path"])
def test_w8g32_engine_agrees_with_float32(fixture: str, request: pytest.FixtureRequest) -> None:
    path = str(request.getfixturevalue(fixture))
    f32 = LLM(path, block_size=8, num_blocks=64)
    w8 = LLM(path, block_size=8, num_blocks=64, quantization="w8g32", prefill_format="none")
    model = w8.engine.model
    assert all(isinstance(p, w8g32.W8G32Linear) for p in model.layers[0].quantized.values())
    assert isinstance(model.quantized_head, w8g32.W8G32Linear)
    assert model.layers[0].qkv.numel() == 0 and model.lm_head.numel() == 0  # float copies freed
    assert quantize.projection_bytes(model) < 0.32 * quantize.projection_bytes(f32.engine.model)
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in f32.generate(PROMPTS, p)]
    got = [o.outputs[0].token_ids for o in w8.generate(PROMPTS, p)]
    # Random tiny weights have flat logits (near ties), so this is looser than the real model.
    assert greedy_agreement(ref, got) >= 0.6
    assert w8.engine.stats()["quantization"] == "w8g32"
    assert_engine_idle(w8)


def test_w8g32_without_avx2_is_a_start_up_error(
    tiny_llama_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What torch reports under ATEN_CPU_CAPABILITY=default or on a CPU without AVX2.
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.raises(ValueError, match=r"w8g32.*AVX2"):
        quantize.check_supported("w8g32", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="AVX2"):
        LLM(str(tiny_llama_path), quantization="w8g32")
    with pytest.raises(ValueError, match="float32"):
        quantize.check_supported("w8g32", torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 5])
def test_fused_rms_norm_and_rope_match_torch(isa: str, rows: int) -> None:
    from pdserve.engine.models.llama import apply_rope

    torch.manual_seed(rows)
    ops = base.FusedOps(isa)
    x, w = torch.randn(rows, 70), torch.randn(70)
    want = torch.nn.functional.rms_norm(x, (70,), w, 1e-5)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-5)
    heads, d = 5, 16  # q|k heads, then 2 more heads of v that RoPE must leave out
    qkv = torch.randn(rows, (heads + 2) * d)
    cos, sin = torch.randn(rows, 1, d), torch.randn(rows, 1, d)
    want = apply_rope(qkv[:, : heads * d].view(rows, heads, d), cos, sin)
    torch.testing.assert_close(ops.rope(qkv, heads, cos, sin), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="bad head count"):
        ops.rope(qkv, heads + 3, cos, sin)


@pytest.mark.parametrize("isa", ISAS)
def test_fused_silu_mul_matches_torch(isa: str) -> None:
    # 37 = four vectors of 8 and a tail; strided rows (a slice of a wider tensor), and the
    # exp's edges (large |gate|: exp under- / overflow; zeros) in a vector and in the tail.
    torch.manual_seed(7)
    ops = base.FusedOps(isa)
    wide = torch.randn(4, 80) * 4
    gate_up = wide[:, :74]  # [4, 2 * 37], row stride 80
    edges = torch.tensor([100.0, -100.0, 0.0, -0.0, 88.5])
    gate_up[0, :5] = gate_up[1, 32:37] = edges
    gate, up = gate_up[:, :37], gate_up[:, 37:]
    want = torch.nn.functional.silu(gate) * up
    got = ops.silu_mul(gate_up, 37)
    assert got.shape == (4, 37) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"2 \* I"):
        ops.silu_mul(gate_up, 36)


@pytest.mark.parametrize("isa", ISAS)
def test_w8g32_residual_is_added_as_torch_adds_it(isa: str) -> None:
    # `residual + (x @ W + bias)` bit for bit, from the kernel's store and from the prefill
    # path (torch's GEMM, then an in-place add); a strided residual; a wrong shape refused.
    torch.manual_seed(11)
    w, b = torch.randn(70, 40) * 0.05, torch.randn(40)
    lin = w8g32.W8G32Linear(w, b, isa=isa)
    for rows in (1, 3, 40):
        x = torch.randn(rows, 70)
        wide = torch.randn(rows, 50)
        residual = wide[:, 5:45]
        assert torch.equal(lin(x, residual), residual + lin(x))
    with pytest.raises(RuntimeError, match="residual"):
        lin(torch.randn(2, 70), torch.randn(3, 40))
