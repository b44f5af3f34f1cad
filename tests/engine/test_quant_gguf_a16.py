"""`quantization="gguf-a16"`: the file's own Q4_1 weights against int16 activations. The
activations' codes against a reference rounding, the kernel against a float64 product of those
codes with the file's weights, both builds bit for bit, the projections each file tensor
reaches, and the default model answering as gguf does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.engine.test_quant_gguf import Q4_1, _dequantized, _file_weight
from tests.engine.test_quant_w8a8 import ISAS, VNNI

from factories import greedy_agreement
from pdserve import LLM, SamplingParams
from pdserve.engine import kernels
from pdserve.engine.linear import w8a8
from pdserve.engine.linear.gguf import Q41A8Linear, Q41A16Linear, Q41Linear


def _codes16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) as the kernel rounds it: per row and group of 32 inputs,
    x * (32767 / max |x|) in float32, to nearest even; (codes [M, K], scales [M, K / 32])."""
    m, k = x.shape
    xg = x.view(m, -1, 32)
    amax = xg.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
    return torch.round(xg * inv).view(m, k), (amax / 32767.0).view(m, -1)


def _reference(weight: object, x: torch.Tensor) -> torch.Tensor:
    """The rows rounded as above times the file's weights, in float64."""
    q, s = _codes16(x)
    return (q.double() * s.double().repeat_interleave(32, dim=1)) @ _dequantized(weight).double()


@pytest.mark.parametrize("isa", ISAS)
def test_the_activations_are_rounded_to_int16_per_32_inputs(isa: str) -> None:
    ops = kernels.load("w8a8", isa)
    x = torch.randn(5, 96) * torch.tensor([1e-3, 1.0, 50.0]).repeat_interleave(32)
    x[1, 32:64] = 0.0  # an all-zero group: codes 0, scale 0
    x[2, 5] = 2.5 * x[2, 0:32].abs().max()  # the block's max, exactly +-32767
    codes, scales = ops.quantize_activations16(x)
    want, want_scales = _codes16(x)
    assert torch.equal(codes.float(), want) and torch.equal(scales, want_scales)
    assert codes[2, 5].abs().item() == 32767 and (codes[1, 32:64] == 0).all()


def test_gguf_a16_is_far_closer_to_the_float_activations_than_gguf_a8() -> None:
    # int16 rounding is 256x finer than int8's: the error against gguf's float kernel drops by
    # about that much (a pair order or scale mix-up would leave an error of order 1).
    weight = _file_weight(np.random.default_rng(9).standard_normal((64, 576)) * 0.05, Q4_1)
    x = torch.randn(8, 576)
    exact = Q41Linear([weight])(x)
    err16 = ((Q41A16Linear([weight])(x) - exact).norm() / exact.norm()).item()
    err8 = ((Q41A8Linear([weight])(x) - exact).norm() / exact.norm()).item()
    assert 0 < err16 < 1e-4 and err16 < err8 / 50


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("k", "n"), [(576, 100), (64, 48), (32, 7)])
def test_int8_weights_on_int16_activations_match_the_rounded_reference(
    isa: str, k: int, n: int
) -> None:
    # gguf-a16's Q8_0 head: w8g32's codes and scales (W8A8Linear's quads, without the VNNI
    # build's offset) against the rows rounded as above; every row block, bias and residual.
    torch.manual_seed(k + n)
    w, bias = torch.randn(k, n) * 0.05, torch.randn(n)
    lin = w8a8.W8A16Linear(w, bias, isa=isa)
    assert lin._ops.isa == isa
    assert torch.equal(lin.dequantized(), w8a8.W8A8Linear(w, isa=isa).dequantized())
    for rows in (1, 2, 3, 5, 8, 9, 20):
        x = torch.randn(rows, k) * 3
        q, s = _codes16(x)
        want = (q.double() * s.double().repeat_interleave(32, dim=1)) @ lin.dequantized().double()
        want += bias.double()
        torch.testing.assert_close(lin(x).double(), want, rtol=1e-5, atol=1e-4)
        res = torch.randn(rows, n)
        torch.testing.assert_close(lin(x, res).double(), want + res.double(), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="whole groups"):
        w8a8.W8A16Linear(torch.randn(40, 8))


@pytest.mark.skipif(
    not VNNI,
    reason="compares the AVX-512 VNNI build with the AVX2 one; an AVX2-only CPU cannot run it",
)
def test_int8_weights_on_int16_activations_builds_agree_bit_for_bit() -> None:
    w = torch.randn(192, 70) * 0.05
    a2, vn = w8a8.W8A16Linear(w, isa="avx2"), w8a8.W8A16Linear(w, isa="vnni")
    assert torch.equal(a2.q, vn.q)  # no offset in either build
    for rows in (1, 2, 11):
        x = torch.randn(rows, 192) * 2
        assert torch.equal(vn(x), a2(x))


@pytest.mark.default_model
@pytest.mark.slow
def test_default_model_runs_gguf_a16() -> None:
    llm = LLM(quantization="gguf-a16", prefill_format="none", threads=1)
    assert llm.engine.stats()["quantization"] == "gguf-a16"
    assert llm.engine.stats()["kv_cache_dtype"] == "float16"
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=16, temperature=0))  # fmt: skip
    assert "Paris" in out[0].outputs[0].text
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
    p = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ref = [
        o.outputs[0].token_ids
        for o in LLM(quantization="gguf", prefill_format="none", threads=1).generate(prompts, p)
    ]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    # gguf and gguf-a16 differ by the activations' int16 rounding only (2^-16 of each block's
    # largest input): on 60 chat prompts x 64 tokens both agree with float32 on 98.4%.
    assert greedy_agreement(ref, got) >= 0.9
