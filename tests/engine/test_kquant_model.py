"""A K-quant GGUF (the Q4_K_M mix: Q4_K, Q5_K, Q6_K, a Q8_0 embedding) loads by default on
gguf-a16 and every projection computes with exactly the weights `none` reads from the file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tests.engine import kquant_encode
from tests.engine.test_loader import _permute
from transformers import LlamaConfig, LlamaForCausalLM

from pdserve.engine import loader, quantize
from pdserve.engine.linear import gguf_a16, w8a8
from pdserve.engine.models import gguf_config
from pdserve.engine.models.llama import LlamaModel

# K-quant blocks are 256 inputs: a tiny Llama 256 wide
WIDE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
# As llama.cpp's Q4_K_M mixes them: Q4_K mostly, Q6_K for v and down, here Q5_K for o.
FORMATS = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
           "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}  # fmt: skip
ENCODERS = {
    "Q4_K": kquant_encode.encode_q4_k,
    "Q5_K": kquant_encode.encode_q5_k,
    "Q6_K": kquant_encode.encode_q6_k,
}


@pytest.mark.parametrize("qtype", sorted(ENCODERS))
def test_the_test_encoders_write_what_gguf_reads(qtype: str) -> None:
    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32) * 0.05
    back = gguf.quants.dequantize(ENCODERS[qtype](w), gguf.GGMLQuantizationType[qtype])
    levels = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 63}[qtype]
    # each sub-block within about a quantization step of its range (plus the 6-bit scale's)
    step = (w.max() - w.min()) / levels
    assert back.shape == w.shape and np.abs(back - w).max() <= 0.75 * step


def write_kquant_gguf(path: Path) -> None:
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**WIDE)).eval()
    names = {
        v.removesuffix(".weight"): k.removesuffix(".weight") for k, v in gguf_config._TOP.items()
    }
    names.update(
        {
            f"model.layers.{i}.{h}": f"blk.{i}.{g}"
            for i in range(2)
            for g, h in gguf_config._BLOCK.items()
        }
    )
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-kquant")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(64)
    writer.add_vocab_size(128)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for hf_name, tensor in hf.state_dict().items():
        w = tensor.numpy()
        stem, _, suffix = hf_name.rpartition(".")
        name = f"{names[stem]}.{suffix}"
        if name == "output.weight":
            continue  # tied
        if ".attn_q." in name:
            w = _permute(w, 4)
        elif ".attn_k." in name:
            w = _permute(w, 2)
        kind = FORMATS.get(name.split(".")[2]) if name.startswith("blk.") and w.ndim == 2 else None
        if name == "token_embd.weight":
            q8 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif kind is not None:
            raw = ENCODERS[kind](np.ascontiguousarray(w, np.float32))
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_k_quant_file_runs_its_own_weights_on_gguf_a16(tmp_path: Path) -> None:
    write_kquant_gguf(tmp_path / "kq.gguf")
    src = loader.resolve_model(tmp_path / "kq.gguf")
    assert quantize.resolve_quantization("auto", src) == "gguf-a16"  # no silent float
    arch = loader.load_arch(src)
    model = LlamaModel(arch)
    model.load_hf_weights(loader.load_weights(src, arch))  # `none`: gguf's dequantize
    floats = {
        (i, p): getattr(layer, p).detach().clone()
        for i, layer in enumerate(quantize.layers_of(model))
        for p in quantize.LAYER_PROJECTIONS
    }
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    quantize.quantize_model(model, "gguf-a16", gguf=quantize.gguf_weights(src, arch))
    codes, nibbles = gguf_a16.CodesA16Linear, gguf_a16.NibbleA16Linear
    kinds = {"qkv": codes, "o": codes, "gate_up": nibbles, "down": codes}
    for (i, p), want in floats.items():
        got = quantize.layers_of(model)[i].quantized[p]
        assert type(got) is kinds[p], (i, p)
        assert torch.equal(got.dequantized(), want), (i, p)  # type: ignore[attr-defined]
        if p != "down":  # down takes the 512-wide MLP activations
            y, ref = got(x), x.double() @ want.double()
            assert (y.double() - ref).abs().max() <= 1e-3 * ref.abs().max(), (i, p)
    assert isinstance(model.quantized_head, w8a8.W8A16Linear)  # the Q8_0 embedding
