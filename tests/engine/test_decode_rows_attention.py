"""Prompt rows left on the decode format (a decode worker's own prefills, a colocated step's few
prompt rows) attend on bf16x3's AMX kernel where the prefill format would be bf16x3
(prefill_format.decode_rows_attention), and compute what SDPA does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tests.engine.test_prefill_format import needs_amx

from pdserve import LLM, SamplingParams
from pdserve.engine import kernels, prefill_format
from pdserve.engine.prefill_format import MatrixUnits, PrefillChoice

AMX = MatrixUnits(amx_bf16=True, avx512_bf16=True)
ZEN4 = MatrixUnits(amx_bf16=False, avx512_bf16=True)
CPU = torch.device("cpu")
NONE = PrefillChoice("none", "amx", "a decode worker holds the decode format only")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def head64_path(tmp_path_factory, default_tokenizer):  # type: ignore[no-untyped-def]
    """A tiny Qwen2 with the AMX kernel's head size (64)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=default_tokenizer.vocab_size, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(7)
    folder = tmp_path_factory.mktemp("head64")
    Qwen2ForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    default_tokenizer.save_pretrained(folder)
    return folder


def _choose(**over: Any) -> object:
    args: dict[str, Any] = dict(
        name="auto", choice=NONE, quantization="w8g32", device=CPU, dtype=torch.float32, units=AMX
    )
    args.update(over)
    return prefill_format.decode_rows_attention(**args)


def test_no_amx_kernel_where_the_prefill_format_would_not_be_bf16x3() -> None:
    assert _choose(units=ZEN4) is None  # no AMX: SDPA
    assert _choose(name="none") is None  # --prefill-format none asked for
    assert _choose(name="bf16") is None  # the one-product format has its own attention
    assert _choose(choice=PrefillChoice("bf16", "amx", "asked for")) is None
    assert _choose(quantization="none") is None  # float32 weights stay exact
    assert _choose(dtype=torch.bfloat16) is None


@needs_amx
def test_the_amx_kernel_where_bf16x3_would_run() -> None:
    amx = kernels.load("amx").causal_attention
    assert _choose() is amx
    assert _choose(name="bf16x3", choice=PrefillChoice("bf16x3", "amx", "asked for")) is amx


@needs_amx
def test_a_decode_worker_prefills_a_follow_up_on_amx_attention(head64_path) -> None:  # type: ignore[no-untyped-def]
    """A follow-up chunk over a cached history on a decode-only engine goes through the kernel
    and gives SDPA's tokens."""
    fast = LLM(str(head64_path), quantization="w8g32", phases="decode")
    plain = LLM(str(head64_path), quantization="w8g32", phases="decode")
    kernel = fast.engine.model.decode_rows_attention
    assert kernel is kernels.load("amx").causal_attention
    plain.engine.model.decode_rows_attention = None
    calls: list[tuple[int, int]] = []

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        calls.append((q.shape[0], k.shape[0]))
        return kernel(q, k, v, scale)

    fast.engine.model.decode_rows_attention = spy
    g = torch.Generator().manual_seed(5)
    history = torch.randint(3, 1000, (160,), generator=g).tolist()
    follow = history + torch.randint(3, 1000, (40,), generator=g).tolist()
    for llm in (fast, plain):
        llm.generate([history], GREEDY)  # the history's KV in the prefix cache
    got = fast.generate([follow], GREEDY)[0].outputs[0].token_ids
    want = plain.generate([follow], GREEDY)[0].outputs[0].token_ids
    assert got == want
    assert any(n >= 40 and ctx >= 200 for n, ctx in calls), calls  # the chunk over its history
