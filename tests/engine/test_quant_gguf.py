"""`quantization="gguf"`: the Q4_1 kernel against the gguf library's own dequantization (both
builds, every row count, bias and residual), the file's tensors reaching the right projections
(Q/K unpermuted, fused in order, Q8_0 held exactly by w8g32), the clear errors, and the default
model answering with its own Q4_1 weights."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tests.engine.test_loader import TINY, _write_tiny_gguf
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from factories import greedy_agreement
from pdserve import LLM, SamplingParams
from pdserve.engine import loader, quantize
from pdserve.engine.linear import base, gguf_a16, w8a8, w8g32
from pdserve.engine.linear import gguf as gguf_linear
from pdserve.engine.linear.gguf import GgufWeight, Q41A8Linear, Q41A16Linear, Q41Linear
from pdserve.engine.models.llama import LlamaModel

Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q8_0 = gguf.GGMLQuantizationType.Q8_0
AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
ISAS = ["avx2", pytest.param("avx512", marks=pytest.mark.skipif(not AVX512, reason="no AVX-512"))]


def _file_weight(w_out_in: np.ndarray, qtype: gguf.GGMLQuantizationType) -> GgufWeight:
    """A [out, in] float matrix as a GGUF file stores it in `qtype` blocks."""
    return GgufWeight(qtype.name, gguf.quants.quantize(w_out_in.astype(np.float32), qtype))


def _dequantized(weight: GgufWeight) -> torch.Tensor:
    """The gguf library's reading of the blocks, as [in, out]: the reference."""
    qtype = gguf.GGMLQuantizationType[weight.qtype]
    return torch.from_numpy(gguf.quants.dequantize(weight.raw, qtype)).T.contiguous()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("k", "n"), [(64, 48), (576, 200), (32, 17), (96, 5)])
def test_q4_1_kernel_matches_the_gguf_dequantization(isa: str, k: int, n: int) -> None:
    # Every row count the streaming kernel dispatches (its kRows blocks and remainders), ragged
    # tiles (n % 16), then past the row limit the dequantize + GEMM path; bias and residual.
    rng = np.random.default_rng(k * 100 + n)
    weight = _file_weight(rng.standard_normal((n, k)) * 0.05, Q4_1)
    ref = _dequantized(weight)
    bias = torch.randn(n)
    lin = Q41Linear([weight], bias, isa=isa)
    assert lin._ops.isa == isa and (lin.in_features, lin.out_features) == (k, n)
    # Bit for bit the gguf package's weights (what `none` loads): prefill, which multiplies the
    # dequantized weights with torch's GEMM, computes exactly what `none` computes.
    assert torch.equal(lin.dequantized(), ref)
    for rows in [*range(1, base.W8G32_GEMV_ROWS + 1, 3), base.W8G32_GEMV_ROWS + 5]:
        x = torch.randn(rows, k)
        torch.testing.assert_close(lin(x), x @ ref + bias, rtol=1e-4, atol=1e-4)
        res = torch.randn(rows, n)
        want = res + (x @ ref + bias)
        torch.testing.assert_close(lin(x, residual=res), want, rtol=1e-4, atol=1e-4)
    x3 = torch.randn(2, 3, k)  # leading dimensions are kept
    torch.testing.assert_close(lin(x3), x3 @ ref + bias, rtol=1e-4, atol=1e-4)
    tiles, groups = -(-n // 16), k // 32
    assert lin.nbytes == tiles * 16 * k // 2 + 2 * 2 * tiles * 16 * groups + 4 * n


@pytest.mark.skipif(not AVX512, reason="needs a CPU where torch reports AVX512")
def test_q4_1_avx512_and_avx2_builds_agree() -> None:
    weight = _file_weight(np.random.default_rng(5).standard_normal((90, 192)), Q4_1)
    a2, a5 = Q41Linear([weight], isa="avx2"), Q41Linear([weight], isa="avx512")
    x = torch.randn(11, 192)
    torch.testing.assert_close(a5(x), a2(x), rtol=1e-5, atol=1e-5)


def test_fused_parts_are_concatenated_in_order() -> None:
    rng = np.random.default_rng(7)
    parts = [_file_weight(rng.standard_normal((r, 64)), Q4_1) for r in (32, 16, 16)]
    lin = Q41Linear(parts)
    assert torch.equal(lin.dequantized(), torch.cat([_dequantized(p) for p in parts], dim=1))


def test_q8_0_runs_on_w8g32_with_the_same_codes_and_scales() -> None:
    weight = _file_weight(np.random.default_rng(3).standard_normal((40, 96)), Q8_0)
    ref = _dequantized(weight)
    lin = gguf_linear.projection([weight], ref, None, "t")
    assert isinstance(lin, w8g32.W8G32Linear)
    assert torch.equal(lin.dequantized(), ref)  # exactly the file's weights


def test_unsupported_and_mixed_formats_are_start_up_errors() -> None:
    w = torch.zeros(64, 32)
    q4 = _file_weight(np.ones((32, 64)), Q4_1)
    q8 = _file_weight(np.ones((32, 64)), Q8_0)
    k_quant = GgufWeight("Q4_K", np.zeros((32, 144), np.uint8))
    # K-quants and mixed formats run on int16 activations (gguf-a16) only
    with pytest.raises(ValueError, match=r"layer 3 down is Q4_K, which runs under .*gguf-a16"):
        gguf_linear.projection([k_quant], w, None, "layer 3 down")
    with pytest.raises(ValueError, match=r"layer 0 qkv is Q4_1\+Q8_0, which runs under"):
        gguf_linear.projection([q4, q8], w, None, "layer 0 qkv", "int8")
    mixed = gguf_linear.projection([q4, q8], w, None, "layer 0 qkv", "int16")
    assert isinstance(mixed, gguf_a16.CodesA16Linear)
    iq = GgufWeight("IQ4_XS", np.zeros((32, 136), np.uint8))
    with pytest.raises(ValueError, match=r"layer 1 o is IQ4_XS, which pdserve has no kernel"):
        gguf_linear.projection([iq], w, None, "layer 1 o", "int16")
    f32 = GgufWeight("F32", np.zeros((32, 256), np.uint8))
    assert gguf_linear.projection([f32], w, None, "") is None
    with pytest.raises(ValueError, match="whole blocks"):
        gguf_linear.pack_q4_1(np.zeros((4, 30), np.uint8))


def tiny_q4_1_model(kind: str, folder: Path) -> tuple[LlamaModel, dict, torch.Tensor, dict]:
    """A tiny model written as llama.cpp writes a Q4_1 file (Llama's Q/K rows permuted, a Q8_0
    embedding when tied), loaded as `none` loads it: (model, its float projections by (layer,
    name), its float LM head, the file's own tensors for quantize_model)."""
    torch.manual_seed(0)
    if kind == "llama":
        hf = LlamaForCausalLM(LlamaConfig(**TINY, bos_token_id=1, eos_token_id=2))
    else:
        hf = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True))
    _write_tiny_gguf(hf.eval(), folder / "tiny.gguf", arch=kind, blocks=Q4_1)
    src = loader.resolve_model(folder / "tiny.gguf")
    arch = loader.load_arch(src)
    model = LlamaModel(arch)
    model.load_hf_weights(loader.load_weights(src, arch))
    floats = {
        (i, p): getattr(layer, p).detach().clone()
        for i, layer in enumerate(quantize.layers_of(model))
        for p in quantize.LAYER_PROJECTIONS
    }
    return model, floats, model.lm_head.detach().clone(), quantize.gguf_weights(src, arch)


# What each GGUF quantization runs a Q4_1 projection (by name) and a Q8_0 head on.
_KERNELS = {
    "gguf": (lambda p: Q41Linear, w8g32.W8G32Linear),
    "gguf-a8": (
        lambda p: Q41Linear if p in quantize.W8A8_FLOAT_ACTIVATIONS else Q41A8Linear,
        w8a8.W8A8Linear,
    ),
    "gguf-a16": (lambda p: Q41A16Linear, w8a8.W8A16Linear),
}


@pytest.mark.parametrize("quantization", list(_KERNELS))
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_files_q4_1_tensors_reach_their_projections(
    quantization: str, kind: str, tmp_path: Path
) -> None:
    # Every projection must compute with exactly what `none` loads from the file, on its
    # quantization's kernel: gguf-a8 keeps q|k|v on float activations (as w8a8), gguf-a16 runs
    # every projection and the Q8_0 head on int16 ones.
    model, floats, head, tensors = tiny_q4_1_model(kind, tmp_path)
    projection_kind, head_kind = _KERNELS[quantization]
    quantize.quantize_model(model, quantization, gguf=tensors)
    for (i, p), want in floats.items():
        got = quantize.layers_of(model)[i].quantized[p]
        assert type(got) is projection_kind(p), (i, p)
        assert torch.equal(got.dequantized(), want), (i, p)
    if model.arch.tie_word_embeddings:  # the head is the Q8_0 embedding: exactly its weights
        assert type(model.quantized_head) is head_kind
        assert torch.equal(model.quantized_head.dequantized(), head)
    else:  # a float32 output.weight in the file stays float32
        assert model.quantized_head is None and torch.equal(model.lm_head, head)


@pytest.mark.parametrize("quantization", list(_KERNELS))
def test_gguf_on_a_model_that_is_not_gguf_is_a_start_up_error(
    quantization: str, tiny_llama_path: Path
) -> None:
    with pytest.raises(ValueError, match="not a GGUF model"):
        LLM(str(tiny_llama_path), quantization=quantization)


@pytest.mark.parametrize("kind", [Q41Linear, Q41A8Linear, Q41A16Linear])
def test_q4_1_projections_reject_a_wrong_input_width(kind: type) -> None:
    lin = kind([_file_weight(np.ones((16, 64)), Q4_1)])
    with pytest.raises(ValueError, match="64"):
        lin(torch.randn(2, 96))


@pytest.mark.default_model
@pytest.mark.slow
def test_default_model_runs_its_own_q4_1_weights() -> None:
    llm = LLM(quantization="gguf", prefill_format="none", threads=1)
    model = llm.engine.model
    assert all(isinstance(p, Q41Linear) for p in model.layers[0].quantized.values())
    assert isinstance(model.quantized_head, w8g32.W8G32Linear)  # the file's Q8_0 embedding
    assert llm.engine.stats()["quantization"] == "gguf"
    p = SamplingParams(max_tokens=24, temperature=0)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], p)
    assert "Paris" in out[0].outputs[0].text
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
    ref_llm = LLM(threads=1)  # `none`: the same file's weights dequantized to float32
    p = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, p)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    # The same weights summed in another order: only a near-tie may flip.
    assert greedy_agreement(ref, got) >= 0.9


def test_auto_is_gguf_a16_only_for_a_gguf_file_it_has_kernels_for(
    tmp_path: Path, tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY, bos_token_id=1, eos_token_id=2)).eval()
    q4 = _write_tiny_gguf_at(hf, tmp_path / "q4", Q4_1)
    f32 = _write_tiny_gguf_at(hf, tmp_path / "f32", None)  # only the embedding is Q8_0
    q5 = _write_tiny_gguf_at(hf, tmp_path / "q5", gguf.GGMLQuantizationType.Q5_0)
    resolve = quantize.resolve_quantization
    assert resolve("auto", q4) == "gguf-a16"
    assert resolve("auto", f32) == "gguf-a16"  # its Q8_0 embedding has a kernel; the rest float
    assert resolve("auto", q5) == "gguf-a16"  # Q5_0 runs on int8 codes (gguf_linear)
    assert resolve("auto", str(tiny_llama_path)) == "none"  # an HF folder
    assert resolve("auto", q4, "cpu", torch.bfloat16) == "none"
    assert resolve("auto", q4, "cuda") == "none"
    assert resolve("w8a8", q4) == "w8a8" and resolve("none", q4) == "none"  # asked: kept
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert resolve("auto", q4) == "none"  # no AVX2: the kernel cannot run


def test_auto_warns_loudly_when_a_file_runs_as_float(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A block format without a kernel (here Q5_0 with its kernel taken away) runs as float32
    under a WARNING that names the format and the cost: never silently."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY, bos_token_id=1, eos_token_id=2)).eval()
    q5 = _write_tiny_gguf_at(hf, tmp_path / "q5", gguf.GGMLQuantizationType.Q5_0)
    monkeypatch.setattr(gguf_a16, "FORMATS", ("Q4_1", "Q8_0"))
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.quantize"):
        assert quantize.resolve_quantization("auto", q5) == "none"
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "Q5_0" in warned[0].getMessage()
    assert "float32" in warned[0].getMessage() and "slower" in warned[0].getMessage()


def _write_tiny_gguf_at(
    hf: LlamaForCausalLM, folder: Path, blocks: gguf.GGMLQuantizationType | None
) -> loader.ModelSource:
    folder.mkdir()
    _write_tiny_gguf(hf, folder / "m.gguf", blocks=blocks)
    return loader.resolve_model(folder / "m.gguf")
