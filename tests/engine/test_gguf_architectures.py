"""Every architecture read from GGUF metadata (engine/models/gguf_config.py) against
transformers: a tiny random model (tiny_arch) written the way llama.cpp's converter writes it
(gguf_convert), loaded by pdserve: the same ModelArch as its config.json gives, greedy tokens
equal to transformers' float32 ones on prompts past the sliding windows, last-position
logprobs within 1e-4. Then the same file as F16 and BF16, and with quantized blocks
(Phi-3's fused projections, Qwen3-MoE's experts) run as stored."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import gguf_convert
import tiny_arch
from factories import assert_engine_idle, greedy_agreement
from pdserve import LLM, SamplingParams
from pdserve.engine import loader, model_cache, quantize
from pdserve.engine.models.arch import ModelArch

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# tiny_arch variant -> overrides making it what llama.cpp can express: GGUF has no
# query_pre_attn_scalar (llama.cpp scales by head_dim) and Gemma 3 files no layer pattern
# (llama.cpp: five sliding layers, then a global one).
VARIANTS: dict[str, dict[str, Any]] = {
    "qwen3": {},
    "qwen3_moe-norm": {},
    "phi3": {},
    "phi3-window": {},
    "gemma2": {"query_pre_attn_scalar": 32},
    "gemma3": {"num_hidden_layers": 6, "layer_types": None},
}


@pytest.fixture(autouse=True)
def _tokenizer(default_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The tiny files hold no tokenizer: the default model's stands in.
    monkeypatch.setattr(model_cache, "gguf_tokenizer", lambda _: default_tokenizer)


@pytest.fixture(scope="module", params=list(VARIANTS))
def converted(request, tmp_path_factory, default_tokenizer):  # type: ignore[no-untyped-def]
    """(name, HF folder, its GGUF file, transformers' model, prompts, its greedy tokens)."""
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    model = tiny_arch.save(folder, name, default_tokenizer, **VARIANTS[name])
    path = gguf_convert.write(folder, folder / "tiny.gguf")
    prompts = tiny_arch.prompts()
    want = [tiny_arch.hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    return name, folder, path, model, prompts, want


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _neutral(arch: ModelArch) -> ModelArch:
    """The fields a file's metadata may spell differently: its name, the tokenizer's ids, and
    the RMSNorm epsilon, which GGUF stores as float32."""
    return dataclasses.replace(arch, name="", eos_token_ids=(), bos_token_id=None, rms_norm_eps=0)


def test_gguf_gives_the_config_arch_and_transformers_tokens(converted) -> None:  # type: ignore[no-untyped-def]
    name, folder, path, ref, prompts, want = converted
    arch = loader.load_arch(loader.resolve_model(path))
    assert _neutral(arch) == _neutral(loader.load_arch(loader.resolve_model(folder)))
    assert abs(arch.rms_norm_eps - ref.config.rms_norm_eps) <= 1e-12
    if name == "gemma3":  # llama.cpp's period of 6, as transformers' default
        assert arch.layer_types == ("sliding",) * 5 + ("full",)
    llm = LLM(str(path), block_size=8, num_blocks=256)
    assert llm.engine.quantization == "none"
    assert _tokens(llm, prompts) == want
    with torch.no_grad():
        ref_lp = torch.log_softmax(ref(torch.tensor([prompts[2]])).logits[0, -1], -1)
    out = llm.generate([prompts[2]], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    got = out[0].outputs[0].logprobs[0]
    assert got and all(abs(lp - ref_lp[t].item()) < 1e-4 for t, lp in got.items())
    assert_engine_idle(llm)


@pytest.mark.parametrize("ftype", ["F16", "BF16"])
def test_16_bit_files_load_and_say_they_run_as_float32(
    ftype: str, tmp_path: Path, default_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Every weight matrix in F16 (BF16), norms in F32, as the converter's --outtype: the
    same tokens and logprobs as transformers on the same weights rounded to 16 bits."""
    model = tiny_arch.save(tmp_path, "qwen3", default_tokenizer)
    path = gguf_convert.write(tmp_path, tmp_path / f"tiny.{ftype}.gguf", ftype=ftype)
    half = torch.float16 if ftype == "F16" else torch.bfloat16
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(p.to(half).float())
    prompts = tiny_arch.prompts((3, 40))
    want = [tiny_arch.hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.quantize"):
        llm = LLM(str(path), block_size=8, num_blocks=64)
    assert f"holds {ftype} weights, which run as float32" in caplog.text
    assert llm.engine.quantization == "none"
    assert _tokens(llm, prompts) == want
    with torch.no_grad():
        ref_lp = torch.log_softmax(model(torch.tensor([prompts[1]])).logits[0, -1], -1)
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    got = out[0].outputs[0].logprobs[0]
    assert got and all(abs(lp - ref_lp[t].item()) < 1e-4 for t, lp in got.items())


def _quantized_pair(path: Path) -> tuple[LLM, LLM]:
    """The file read as float32 (`none`: gguf's dequantize) and run as stored (auto; prompts
    on the decode format too, so every projection is the file's blocks)."""
    assert quantize.resolve_quantization("auto", loader.resolve_model(path)) == "gguf-a16"
    kw: dict[str, Any] = dict(block_size=8, num_blocks=128, prefill_format="none")
    return LLM(str(path), quantization="none", **kw), LLM(str(path), **kw)


def test_phi3_fused_projections_run_their_own_blocks(
    tmp_path: Path, default_tokenizer: Any
) -> None:
    """attn_qkv and ffn_up (gate|up) in Q8_0 / Q4_1: split by rows into q, k, v and gate, up,
    each part the file's own blocks, exactly the weights the float reading has."""
    tiny_arch.save(tmp_path, "phi3", default_tokenizer)
    blocks = {"attn_qkv": "Q8_0", "ffn_up": "Q4_1", "attn_output": "Q8_0", "ffn_down": "Q8_0"}
    path = gguf_convert.write(tmp_path, tmp_path / "tiny.gguf", blocks=blocks)
    f32, a16 = _quantized_pair(path)
    assert a16.engine.quantization == "gguf-a16"
    layers = quantize.layers_of(a16.engine.model), quantize.layers_of(f32.engine.model)
    for layer, float_layer in zip(*layers, strict=True):
        for proj in quantize.LAYER_PROJECTIONS:
            got = layer.quantized[proj].dequantized()  # type: ignore[operator]
            assert torch.equal(got, getattr(float_layer, proj)), proj
    prompts = tiny_arch.prompts()
    assert greedy_agreement(_tokens(f32, prompts), _tokens(a16, prompts)) >= 0.6
    assert_engine_idle(a16)


def test_qwen3_moe_experts_run_their_own_blocks(tmp_path: Path, default_tokenizer: Any) -> None:
    tiny_arch.save(tmp_path, "qwen3_moe-norm", default_tokenizer)
    blocks = {"ffn_gate_exps": "Q4_1", "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q8_0"}
    path = gguf_convert.write(tmp_path, tmp_path / "tiny.gguf", blocks=blocks)
    f32, a16 = _quantized_pair(path)
    for layer, float_layer in zip(a16.engine.model.layers, f32.engine.model.layers, strict=True):
        moe, float_moe = layer.moe, float_layer.moe
        assert moe.quantized is not None and moe.gate_up.numel() == 0
        for e, (gate_up, down) in enumerate(moe.quantized):
            assert torch.equal(gate_up.dequantized(), float_moe.gate_up[e])
            assert torch.equal(down.dequantized(), float_moe.down[e])
    prompts = tiny_arch.prompts()
    assert greedy_agreement(_tokens(f32, prompts), _tokens(a16, prompts)) >= 0.6
    assert_engine_idle(a16)
