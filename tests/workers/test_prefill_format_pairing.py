"""P on the prefill format, D on the decode format: the hand-off pairs them, and workers whose
KV cannot pair (other weights, another architecture, another weight format) are refused at
start with both sides named."""

from __future__ import annotations

import pytest
import torch

import gguf_convert
import tiny_arch
from factories import assert_cluster_idle
from pdserve import LLM, SamplingParams
from pdserve.cluster import LocalCluster

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (40, 90, 150)]


def test_p_bf16_hands_its_kv_to_a_d_on_the_decode_format(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    """P prefills on bf16 copies and samples the first token; D continues on float32 weights
    from the KV P wrote: token for token what one engine holding both formats makes."""
    model = str(tiny_llama_path)
    want = LLM(model, prefill_format="bf16").generate(_prompts(), GREEDY)
    with LocalCluster(model, transport="inproc", engine_args={"prefill_format": "bf16"}) as c:
        outs = c.generate(_prompts(), GREEDY)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in want]
        stats = c.worker_stats()
        assert stats["P0"]["prefill_format"] == "bf16" and stats["D0"]["prefill_format"] == "none"
        assert stats["P0"]["prompt_rows_prefill_format"] == 280
        assert stats["D0"]["handoffs_received"] == 3
        # a P worker keeps no decode copy: its bf16 copies replaced the float32 weights
        assert stats["P0"]["prefill_extra_bytes"] < 0
        assert_cluster_idle(c)


def test_workers_whose_kv_cannot_pair_are_refused(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="cannot pair") as err:
        LocalCluster(
            str(tiny_llama_path), transport="inproc", prefill_args={"quantization": "int8"}
        ).__enter__()
    assert "safetensors, requantized int8)" in str(err.value)
    assert "safetensors, as stored)" in str(err.value)


@pytest.fixture(scope="module")
def moe_and_dense(tmp_path_factory, default_tokenizer):  # type: ignore[no-untyped-def]
    """A tiny Qwen3-MoE (HF folder and its GGUF file) and a dense Qwen3 with the same KV layout
    (2 layers x 2 KV heads x 16)."""
    moe = tmp_path_factory.mktemp("qwen3-moe")
    tiny_arch.save(moe, "qwen3_moe-norm", default_tokenizer)
    dense = tmp_path_factory.mktemp("qwen3")
    tiny_arch.save(dense, "qwen3", default_tokenizer, head_dim=16)
    return moe, gguf_convert.write(moe, moe / "tiny.gguf"), dense


@pytest.mark.parametrize(
    ("p_model", "named"),
    [
        ("dense", ["(qwen3, safetensors, as stored)", "(qwen3_moe, safetensors, as stored)"]),
        ("gguf", ["(qwen3_moe, GGUF F32, as stored)", "(qwen3_moe, safetensors, as stored)"]),
    ],
)
def test_p_and_d_of_another_architecture_or_weight_format_are_refused(
    moe_and_dense,
    p_model,
    named,
    default_tokenizer,
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    """The same KV shape on both sides: P runs another architecture, or the same weights from
    another file format; the router refuses to pair them, naming what each one runs."""
    from pdserve.engine import model_cache

    monkeypatch.setattr(model_cache, "gguf_tokenizer", lambda _: default_tokenizer)
    moe, gguf_file, dense = moe_and_dense
    other = str(dense if p_model == "dense" else gguf_file)
    with pytest.raises(ValueError, match="cannot pair") as err:
        LocalCluster(str(moe), transport="inproc", prefill_args={"model": other}).__enter__()
    assert all(n in str(err.value) for n in named), str(err.value)
