"""P on the prefill format, D on the decode format: the hand-off pairs them, and workers whose
KV cannot pair (other weights) are refused at start with both sides named."""

from __future__ import annotations

import pytest
import torch

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
    assert "requantized int8" in str(err.value) and "(as stored)" in str(err.value)
