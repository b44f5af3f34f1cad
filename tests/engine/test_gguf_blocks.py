"""GGUF block formats: our decoding equals the gguf package's dequantize exactly, and each
gguf-a16 kernel (both builds) matches a matmul over the dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pdserve.engine import gguf_blocks, kernels
from pdserve.engine.gguf_blocks import BLOCK, FORMATS
from pdserve.engine.linear import gguf_a16

# fp16 fields per K-quant block: (byte offset, count); the rest of a block is codes and
# sub-block scales, for which any byte is valid.
_K_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 1)}


def make_rows(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of k inputs as `qtype` blocks: the gguf package's quantizer where it has one,
    random codes with sane fp16 scales (0.001..0.05) for the K-quants it cannot write."""
    rng = np.random.default_rng(seed)
    if qtype not in _K_HALVES:
        x = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        return quants.quantize(x, GGMLQuantizationType[qtype])
    size, per = BLOCK[qtype]
    raw = rng.integers(0, 256, (n * k // per, size), dtype=np.uint8)
    at, count = _K_HALVES[qtype]
    halves = rng.uniform(0.001, 0.05, (raw.shape[0], count)).astype(np.float16)
    raw[:, at : at + 2 * count] = halves.view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", FORMATS)
def test_decode_equals_gguf_dequantize_bit_for_bit(qtype: str) -> None:
    raw = make_rows(qtype, 8, 512)
    ours = gguf_blocks.decode(qtype, raw).dequantize()
    theirs = quants.dequantize(raw, GGMLQuantizationType[qtype])
    assert ours.shape == theirs.shape == (8, 512)
    assert np.array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))


def test_decode_refuses_unknown_formats_and_partial_blocks() -> None:
    with pytest.raises(ValueError, match="IQ2_XS has no decoder"):
        gguf_blocks.decode("IQ2_XS", np.zeros((2, 66), np.uint8))
    with pytest.raises(ValueError, match="not whole 144-byte blocks"):
        gguf_blocks.decode("Q4_K", np.zeros((2, 100), np.uint8))


class _Part:
    def __init__(self, qtype: str, raw: np.ndarray) -> None:
        self.qtype, self.raw = qtype, raw


def _isas() -> list[str]:
    if not kernels.cpu_supported():
        pytest.skip("no AVX2 CPU: the quantized kernels do not run here")
    return ["avx2"] + (["vnni"] if kernels.w8a8_isa() == "vnni" else [])


# (the parts of one fused projection, the linear class that runs them)
CASES = [
    (("Q4_K",), gguf_a16.NibbleA16Linear),
    (("Q4_0",), gguf_a16.NibbleA16Linear),
    (("Q4_K", "Q4_1"), gguf_a16.NibbleA16Linear),
    (("Q6_K",), gguf_a16.CodesA16Linear),
    (("Q5_K",), gguf_a16.CodesA16Linear),
    (("Q5_0",), gguf_a16.CodesA16Linear),
    (("Q5_1",), gguf_a16.CodesA16Linear),
    (("Q4_K", "Q4_K", "Q6_K"), gguf_a16.CodesA16Linear),  # a Q4_K_M q|k|v
    (("Q8_0", "Q5_K"), gguf_a16.CodesA16Linear),
]


@pytest.mark.parametrize(("kinds", "cls"), CASES)
@pytest.mark.parametrize("rows", [1, 3, 9, 40])
def test_kernel_matches_matmul_over_dequantized_weights(
    kinds: tuple[str, ...], cls: type, rows: int
) -> None:
    k = 512
    parts = [_Part(q, make_rows(q, 24 + 8 * i, k, seed=i)) for i, q in enumerate(kinds)]
    want_w = np.concatenate(
        [quants.dequantize(p.raw, GGMLQuantizationType[p.qtype]) for p in parts]
    )  # [N, K]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(want_w.shape[0])
    residual = torch.randn(rows, want_w.shape[0])
    want = x.double() @ torch.from_numpy(want_w).double().T + bias.double() + residual.double()
    outs = []
    for isa in _isas():
        lin = gguf_a16.projection(parts, bias, "test", isa=isa)
        assert type(lin) is cls
        # the packed weights are the file's, exactly
        assert torch.equal(lin.dequantized(), torch.from_numpy(want_w).T)  # type: ignore[attr-defined]
        y = lin(x, residual)
        assert y.shape == (rows, want_w.shape[0])
        # int16 activations: each input rounded to 2^-16 of its group's largest
        err = (y.double() - want).abs().max().item()
        bound = 2e-4 * (x.abs().sum(1).max().item() * float(np.abs(want_w).max()))
        assert err <= bound, (isa, err, bound)
        outs.append(y)
    assert all(torch.equal(outs[0], o) for o in outs[1:])  # the builds agree bit for bit


def test_projection_refuses_a_format_without_kernel() -> None:
    with pytest.raises(ValueError, match=r"layer 2 down is IQ4_XS, which pdserve has no kernel"):
        gguf_a16.projection([_Part("IQ4_XS", np.zeros((16, 136), np.uint8))], None, "layer 2 down")
