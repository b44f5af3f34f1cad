"""`pdserve bench quant` on a tiny random Llama: the agreement arithmetic and a whole run."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.bench import quant_bench as qb


def test_agreement_counts_tokens_before_the_first_divergence() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    got = [[1, 2, 9, 4], [5, 6, 7, 8]]
    agree, match, identical = qb.agreement(ref, got)
    assert agree == (2 + 4) / 8  # the 4 after the divergence does not count
    assert match == 7 / 8 and identical == 1


def test_whole_run_on_a_tiny_model(tiny_llama_path: Path, tmp_path: Path) -> None:
    md, js = tmp_path / "q.md", tmp_path / "q.json"
    argv = ["bench", "quant", "--model", str(tiny_llama_path), "--threads", "1",
            "--num-prompts", "2", "--max-tokens", "4", "--kl-steps", "2",
            "--variants", "int8,w8g32-fake", "--output", str(md), "--json", str(js)]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(argv) == 0
    rows = {q["name"]: q for q in json.loads(js.read_text())["quality"]}
    assert set(rows) == {"none (reference)", "int8", "w8g32-fake"}  # no llama.cpp: not a GGUF
    ref = rows["none (reference)"]
    assert ref["agreement"] == 1.0 and ref["kl_mean"] == 0.0  # the method checks itself
    for name in ("int8", "w8g32-fake"):
        assert 0.0 <= rows[name]["agreement"] <= 1.0 and 0.0 <= rows[name]["kl_mean"] < 0.1
    assert "| int8 |" in md.read_text()


def test_kv_variants_swap_the_cache_dtype_and_back(tiny_llama_path: Path) -> None:
    import torch

    from pdserve import LLM

    engine = LLM(str(tiny_llama_path), num_blocks=32, enable_prefix_caching=False).engine
    # w8-fake, not w8g32: the same parsing without a kernel build (~30 s on a fresh cache)
    qb.apply_variant(engine, "w8-fake+kv-float16")
    assert engine.cache.dtype == torch.float16
    assert all(k.dtype == torch.float16 for k, _ in engine.cache.layers)
    assert engine.model.layers[0].quantized  # the weights' half of the variant
    qb.apply_variant(engine, "kv-bfloat16")
    assert engine.cache.dtype == torch.bfloat16 and not engine.model.layers[0].quantized
    qb.apply_variant(engine, None)
    assert engine.cache.dtype == torch.float32
    assert all(v.dtype == torch.float32 for _, v in engine.cache.layers)


@pytest.mark.default_model
@pytest.mark.slow
def test_gguf_variants_of_the_default_model_against_a_float32_reference(tmp_path: Path) -> None:
    # The default model, whose default (`auto`) is gguf: the reference must still be float32
    # and every variant built from the float weights (the default once freed them: a crash).
    js = tmp_path / "q.json"
    argv = ["bench", "quant", "--threads", "1", "--num-prompts", "2", "--max-tokens", "4",
            "--kl-steps", "2", "--variants", "gguf,gguf-a8", "--no-llama-cpp",
            "--output", str(tmp_path / "q.md"), "--json", str(js)]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(argv) == 0
    rows = {q["name"]: q for q in json.loads(js.read_text())["quality"]}
    assert set(rows) == {"none (reference)", "gguf", "gguf-a8"}
    assert rows["none (reference)"]["kl_mean"] == 0.0
    # gguf computes with the float32 reference's own weights: only summation order differs.
    assert rows["gguf"]["kl_mean"] < 1e-4 and 0.0 < rows["gguf-a8"]["kl_mean"] < 0.1
