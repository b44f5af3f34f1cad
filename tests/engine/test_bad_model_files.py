"""A damaged model file is a clear start-up error naming the file, before any weight loads."""

from __future__ import annotations

from pathlib import Path

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
