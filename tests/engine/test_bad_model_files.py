"""A damaged model file is a clear start-up error naming the file, before any weight loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from pdserve.engine import loader, model_cache


@pytest.mark.parametrize("keep", [3000, pytest.param(0.5, marks=pytest.mark.slow)])
def test_a_cut_gguf_file_names_itself(
    tmp_path: Path, keep: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model_cache.gguf_index.cache_clear()
    whole = loader.resolve_model(None).path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: int(keep if keep > 1 else len(whole) * keep)])
    with pytest.raises(ValueError, match=r"cut\.gguf (is not a readable GGUF file|is truncated)"):
        loader.load_arch(loader.resolve_model(cut))


def test_a_tensor_past_the_end_is_named(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"\0" * 100)
    tensors = (model_cache.GgufTensor("blk.0.ffn_up.weight", 0, (32, 4), 64, 128),)
    with pytest.raises(ValueError, match=r"m\.gguf is truncated: tensor blk\.0\.ffn_up\.weight"):
        model_cache._check_inside(f, tensors)


def test_a_folder_without_a_tokenizer_says_so(tmp_path: Path, tiny_llama_path: Path) -> None:
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for f in tiny_llama_path.iterdir():
        if f.name in ("config.json", "generation_config.json") or f.suffix == ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match=r"no-tokenizer has no tokenizer"):
        loader.load_tokenizer(loader.resolve_model(folder))


# ---- GGUF files this engine does not implement: refused by load_arch, naming file and field ----


def _gguf(path: Path, arch: str, meta: dict[str, Any], tensors: dict[str, np.ndarray]) -> Path:
    """A tiny GGUF file: `arch`'s required keys (4 heads of 16, 1 layer) plus `meta` (keys
    without the arch prefix; lists as arrays), and `tensors` beside a token embedding."""
    writer = gguf.GGUFWriter(path, arch)
    base = {"block_count": 1, "embedding_length": 64, "feed_forward_length": 96,
            "attention.head_count": 4, "attention.head_count_kv": 4}  # fmt: skip
    for key, value in {**base, **meta}.items():
        full = f"{arch}.{key}"
        if isinstance(value, str):
            writer.add_string(full, value)
        elif isinstance(value, list):
            writer.add_array(full, value)
        else:
            writer.add_uint32(full, value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_Q = np.zeros((64, 64), np.float32)
REFUSED = {
    "unknown architecture": (
        "mamba", {}, {}, r"general\.architecture='mamba' is not supported; supported: llama"
    ),
    "unknown tensor": (
        "qwen3", {}, {"blk.0.attn_gate.weight": _Q},
        r"unknown tensor 'blk\.0\.attn_gate\.weight' for GGUF architecture 'qwen3'",
    ),
    "a weight type with no dequantization": (
        "qwen3", {}, {"blk.0.attn_q.weight": np.zeros((64, 64), np.int8)},
        r"tensor blk\.0\.attn_q\.weight is stored as I8",
    ),
    "another RoPE scaling": (
        "qwen3", {"rope.scaling.type": "yarn"}, {},
        r"qwen3\.rope\.scaling\.type='yarn' is not supported",
    ),
    "partial rotary": (
        "phi3", {"rope.dimension_count": 8}, {}, r"phi3\.rope\.dimension_count=8 is not supported"
    ),
    "LongRoPE factors": (
        "phi3", {}, {"rope_factors_long.weight": np.ones(8, np.float32)},
        r"tensor rope_factors_long\.weight \(LongRoPE",
    ),
    "shared experts": (
        "qwen3moe", {"expert_count": 4, "expert_used_count": 2, "expert_shared_count": 1}, {},
        r"qwen3moe\.expert_shared_count=1 is not supported \(shared experts\)",
    ),
    "a MoE model without experts": (
        "qwen3moe", {}, {}, r"metadata key qwen3moe\.expert_count is missing"
    ),
    "a layer pattern of the wrong length": (
        "gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": [True] * 3},
        {}, r"gemma3\.attention\.sliding_window_pattern=\[True, True, True\] is not supported",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_feature_not_implemented_is_refused_naming_file_and_field(
    case: str, tmp_path: Path
) -> None:
    arch, meta, tensors, message = REFUSED[case]
    path = _gguf(tmp_path / "m.gguf", arch, meta, tensors)
    with pytest.raises(ValueError, match=message) as err:
        loader.load_arch(loader.resolve_model(path))
    assert str(path) in str(err.value)


def test_a_tensor_type_unknown_to_the_gguf_package_is_named(tmp_path: Path) -> None:
    path = _gguf(tmp_path / "m.gguf", "qwen3", {}, {"blk.0.attn_q.weight": _Q})
    data = bytearray(path.read_bytes())
    # The tensor's info: name, n_dims (u32), dims (u64 each), type (u32), offset (u64).
    at = data.index(b"blk.0.attn_q.weight") + len(b"blk.0.attn_q.weight")
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at : type_at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(
        ValueError, match=r"m\.gguf: tensor blk\.0\.attn_q\.weight has GGML type id 250"
    ):
        loader.load_arch(loader.resolve_model(path))
