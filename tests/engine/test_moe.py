"""Mixture of experts (engine/models/moe.py, engine/moe_quant.py): a tiny random-weight Mixtral
(transformers' own MixtralConfig, saved with save_pretrained) against transformers in float32,
batched against one prompt at a time, its experts quantized (w8g32; a GGUF file's own blocks)
against float, and the routing's grouping (one call per chosen expert, never per token)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tests.engine.test_loader import _permute
from transformers import MixtralConfig, MixtralForCausalLM

from factories import assert_engine_idle, greedy_agreement
from pdserve import LLM, SamplingParams
from pdserve.engine import loader, model_cache, moe_quant, quantize
from pdserve.engine.linear.gguf import Q41A16Linear
from pdserve.engine.linear.w8a8 import W8A16Linear
from pdserve.engine.linear.w8g32 import W8G32Linear
from pdserve.engine.models.arch import ModelArch, MoeArch
from pdserve.engine.models.llama import LlamaModel
from pdserve.engine.models.moe import SparseMoe

VOCAB = 320
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 40, 150)]


def _hf_greedy(model: MixtralForCausalLM, prompt: list[int], n: int = 12) -> list[int]:
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return list(ids[0, len(prompt) :].tolist())


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Any:
    """(folder, transformers' model) of a tiny random Mixtral."""
    folder = tmp_path_factory.mktemp("tiny-mixtral")
    torch.manual_seed(7)
    model = MixtralForCausalLM(MixtralConfig(**TINY)).eval()
    model.save_pretrained(folder)
    default_tokenizer.save_pretrained(folder)
    # No EOS: the engine's ignore_eos samples it like any token (min_new_tokens would mask it).
    model.generation_config.eos_token_id = None
    return folder, model


@pytest.fixture(scope="module")
def hf_tokens(mixtral: Any) -> list[list[int]]:
    """transformers' float32 greedy tokens for _prompts() (seconds: slow tests only)."""
    return [_hf_greedy(mixtral[1], p) for p in _prompts()]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.slow
def test_mixtral_greedy_equals_transformers_batched_and_alone(
    mixtral: Any, hf_tokens: list[list[int]]
) -> None:
    folder, want = mixtral[0], hf_tokens
    llm = LLM(str(folder), block_size=8, num_blocks=128)
    arch = llm.engine.arch
    assert (arch.architecture, arch.moe) == ("mixtral", MoeArch(4, 2, True, 96))
    prompts = _prompts()
    assert _tokens(llm, prompts) == want  # all four in one batch
    assert [_tokens(llm, [p])[0] for p in prompts] == want  # one at a time
    assert_engine_idle(llm)
    stats = llm.engine.stats()
    assert stats["quantization"] == "none" and stats["prefill_format"] == "none"


def _model(folder: Path, quantization: str) -> LlamaModel:
    """The tiny Mixtral as model_build makes it, without an engine around it."""
    src = loader.resolve_model(folder)
    arch = loader.load_arch(src)
    model = LlamaModel(arch)
    model.load_hf_weights(loader.load_weights(src, arch))
    quantize.quantize_model(model, quantization)
    moe_quant.quantize_experts(model, quantization)
    return model


def test_w8g32_quantizes_every_expert_within_its_rounding(mixtral: Any) -> None:
    float_moe = _model(mixtral[0], "none").layers[0].moe
    moe = _model(mixtral[0], "w8g32").layers[0].moe
    assert moe is not None and moe.quantized is not None and len(moe.quantized) == 4
    assert all(isinstance(p, W8G32Linear) for pair in moe.quantized for p in pair)
    assert moe.gate_up.numel() == 0 and moe.down.numel() == 0  # float experts freed
    assert moe.fused is not None  # the native silu * up, as the dense layers
    # Per expert, w8g32's rounding: within half a step (amax / 127 per 32 inputs) of float.
    for e, (gate_up, down) in enumerate(moe.quantized):
        for q, w in ((gate_up, float_moe.gate_up[e]), (down, float_moe.down[e])):
            step = w.abs().reshape(-1, 32, w.shape[1]).amax(dim=1) / 127  # [groups, out]
            err = (q.dequantized() - w).abs().reshape(-1, 32, w.shape[1]).amax(dim=1)
            assert (err <= step / 2 * 1.01 + 1e-7).all()
    # The layer's output (the router stays float, so the same experts are chosen) within 2%
    # of float's, as a norm: each weight is off by up to half a step of its group's amax/127.
    h = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    zero = torch.zeros_like(h)
    want, got = float_moe(h, zero), moe(h, zero)
    assert (got - want).norm() <= 0.02 * want.norm()  # measured 0.97%


@pytest.mark.slow
def test_w8g32_engine_agrees_with_float(mixtral: Any) -> None:
    folder, _ = mixtral
    f32 = LLM(str(folder), block_size=8, num_blocks=128)
    w8 = LLM(str(folder), block_size=8, num_blocks=128, quantization="w8g32")
    prompts = _prompts()
    # Random tiny weights have flat logits (near ties): looser than a real model would be.
    assert greedy_agreement(_tokens(f32, prompts), _tokens(w8, prompts)) >= 0.6
    assert quantize.projection_bytes(w8.engine.model) < 0.35 * quantize.projection_bytes(
        f32.engine.model
    )
    assert w8.engine.stats()["quantization"] == "w8g32"
    assert_engine_idle(w8)


def _tiny_moe(experts: int = 4, top_k: int = 2, norm: bool = True) -> SparseMoe:
    arch = ModelArch("mixtral", 10, 16, 24, 1, 2, 2, 8, moe=MoeArch(experts, top_k, norm, 24))
    moe = SparseMoe(arch)
    g = torch.Generator().manual_seed(3)
    for p in moe.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.3
    return moe


def _per_token_reference(moe: SparseMoe, h: torch.Tensor) -> torch.Tensor:
    """The MoE one token at a time (what the model never does): the test's oracle."""
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        probs = torch.softmax(h[t] @ moe.router, dim=-1)
        w, idx = torch.topk(probs, moe.top_k)
        w = w / w.sum() if moe.norm_topk_prob else w
        for weight, e in zip(w.tolist(), idx.tolist(), strict=True):
            gate, up = (h[t] @ moe.gate_up[e]).chunk(2)
            out[t] += weight * ((torch.nn.functional.silu(gate) * up) @ moe.down[e])
    return out


@pytest.mark.parametrize(("experts", "top_k", "norm"), [(4, 2, True), (8, 3, False), (3, 1, True)])
def test_tokens_are_grouped_one_call_per_chosen_expert(
    experts: int, top_k: int, norm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    moe = _tiny_moe(experts, top_k, norm)
    h = torch.randn(23, 16, generator=torch.Generator().manual_seed(4))
    calls: list[tuple[int, int]] = []
    run = SparseMoe.expert

    def counted(self: SparseMoe, e: int, x: torch.Tensor) -> torch.Tensor:
        calls.append((e, x.shape[0]))
        return run(self, e, x)

    monkeypatch.setattr(SparseMoe, "expert", counted)
    got = moe(h, torch.zeros_like(h))
    torch.testing.assert_close(got, _per_token_reference(moe, h), rtol=1e-5, atol=1e-5)
    _, chosen = moe.route(h)
    want = torch.bincount(chosen.flatten(), minlength=experts).tolist()
    assert calls == [(e, n) for e, n in enumerate(want) if n]  # each chosen expert once
    assert sum(n for _, n in calls) == 23 * top_k


def test_a_config_feature_not_implemented_is_refused(tmp_path: Path) -> None:
    cfg = MixtralConfig(**{**TINY, "hidden_act": "gelu"})
    cfg.architectures = ["MixtralForCausalLM"]
    cfg.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        loader.load_arch(loader.resolve_model(tmp_path))


def test_a_prefill_format_asked_for_is_refused_for_experts(mixtral: Any) -> None:
    folder, _ = mixtral
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(str(folder), block_size=8, num_blocks=16, quantization="w8g32", prefill_format="bf16")


# ---- GGUF: llama.cpp's Mixtral layout (arch "llama", expert_count, 3-D ffn_*_exps) ----------

# llama.cpp's tensor names for the HF ones of a layer.
GGUF_ATTN = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "block_sparse_moe.gate": "ffn_gate_inp"}  # fmt: skip
GGUF_EXPERTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def write_mixtral_gguf(folder: Path, path: Path, formats: dict[str, str]) -> None:
    """The saved HF Mixtral as a GGUF file, the expert tensors stacked [expert, out, in] in
    `formats` (GGUF tensor kind -> block format; the rest float32)."""
    from safetensors.torch import load_file

    hf = load_file(str(folder / "model.safetensors"))
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-mixtral")
    for key, value in (("block_count", 2), ("context_length", 1024), ("embedding_length", 64),
                       ("feed_forward_length", 96), ("head_count", 4), ("head_count_kv", 2),
                       ("vocab_size", VOCAB), ("expert_count", 4), ("expert_used_count", 2),
                       ("bos_token_id", 1), ("eos_token_id", 2)):  # fmt: skip
        getattr(writer, f"add_{key}")(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(1e6)  # MixtralConfig's default

    def add(name: str, w: np.ndarray) -> None:
        kind = formats.get(name.split(".")[2]) if name.startswith("blk.") else None
        if kind is None:
            writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
            return
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    add("token_embd.weight", hf["model.embed_tokens.weight"].numpy())
    add("output_norm.weight", hf["model.norm.weight"].numpy())
    add("output.weight", hf["lm_head.weight"].numpy())
    for i in range(2):
        p = f"model.layers.{i}."
        for stem, kind in GGUF_ATTN.items():
            w = hf[f"{p}{stem}.weight"].numpy()
            w = _permute(w, 4) if kind == "attn_q" else _permute(w, 2) if kind == "attn_k" else w
            add(f"blk.{i}.{kind}.weight", w)
        for stem, kind in GGUF_EXPERTS.items():
            stacked = [hf[f"{p}block_sparse_moe.experts.{e}.{stem}.weight"] for e in range(4)]
            add(f"blk.{i}.{kind}.weight", torch.stack(stacked).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_llm(path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> LLM:
    # The tiny file holds no tokenizer: the folder's (the default model's) stands in.
    monkeypatch.setattr(model_cache, "gguf_tokenizer", lambda _: tokenizer)
    return LLM(str(path), block_size=8, num_blocks=128, **kw)


@pytest.mark.slow
def test_a_float_mixtral_gguf_equals_transformers(
    mixtral: Any,
    hf_tokens: list[list[int]],
    default_tokenizer: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder, want = mixtral[0], hf_tokens
    write_mixtral_gguf(folder, tmp_path / "moe.gguf", {})
    llm = _gguf_llm(tmp_path / "moe.gguf", default_tokenizer, monkeypatch)
    assert llm.engine.arch.moe == MoeArch(4, 2, True, 96) and llm.engine.quantization == "none"
    assert _tokens(llm, _prompts()) == want
    assert_engine_idle(llm)


@pytest.mark.slow
def test_gguf_experts_run_their_own_blocks_per_expert(
    mixtral: Any, default_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, _ = mixtral
    formats = {"ffn_gate_exps": "Q4_1", "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q8_0"}
    write_mixtral_gguf(folder, tmp_path / "moe.gguf", formats)
    src = loader.resolve_model(tmp_path / "moe.gguf")
    assert quantize.resolve_quantization("auto", src) == "gguf-a16"  # the experts counted
    f32 = _gguf_llm(tmp_path / "moe.gguf", default_tokenizer, monkeypatch, quantization="none")
    a16 = _gguf_llm(tmp_path / "moe.gguf", default_tokenizer, monkeypatch)
    assert a16.engine.quantization == "gguf-a16"
    for layer, float_layer in zip(a16.engine.model.layers, f32.engine.model.layers, strict=True):
        moe, float_moe = layer.moe, float_layer.moe
        assert moe.quantized is not None and moe.gate_up.numel() == 0
        for e, (gate_up, down) in enumerate(moe.quantized):
            assert isinstance(gate_up, Q41A16Linear)
            assert isinstance(down, W8A16Linear)
            # exactly the weights `none` reads from the file (gguf's dequantize)
            assert torch.equal(gate_up.dequantized(), float_moe.gate_up[e])
            assert torch.equal(down.dequantized(), float_moe.down[e])
    prompts = _prompts()
    assert greedy_agreement(_tokens(f32, prompts), _tokens(a16, prompts)) >= 0.6
    assert_engine_idle(a16)


def test_p_and_d_of_another_architecture_with_the_same_kv_layout_do_not_pair(
    mixtral: Any, tiny_llama_path: Path
) -> None:
    from pdserve.workers.pool import kv_fingerprint

    moe = LLM(str(mixtral[0]), block_size=8, num_blocks=16, quantization="w8g32")
    dense = LLM(str(tiny_llama_path), block_size=8, num_blocks=16, quantization="w8g32")
    a, b = moe.engine, dense.engine
    # The same KV layout (2 layers x 2 KV heads x 16): only the weights tell them apart.
    assert a.kv_layout.fingerprint() == b.kv_layout.fingerprint()
    assert kv_fingerprint(a)[0] != kv_fingerprint(b)[0]
    stats = a.stats()  # nothing in the stats assumes a dense MLP
    assert stats["quantization"] == "w8g32" and stats["prefill_format"] == "none"
