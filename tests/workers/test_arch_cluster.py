"""1P1D over real workers for the newer architectures: P prefills (the prompt past the sliding
window, Gemma 3's sliding and global layers interleaved, Qwen3-MoE's experts), hands its KV
over, D decodes on; token for token what one colocated engine makes, which is transformers'
greedy output."""

from __future__ import annotations

import pytest

import tiny_arch
from factories import assert_cluster_idle
from pdserve import LLM, SamplingParams
from pdserve.cluster import LocalCluster

pytestmark = pytest.mark.slow  # worker processes

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("name", ["gemma3", "mistral-window", "qwen3", "qwen3_moe"])
def test_1p1d_equals_colocated_and_transformers(tmp_path, default_tokenizer, name) -> None:  # type: ignore[no-untyped-def]
    ref = tiny_arch.save(tmp_path, name, default_tokenizer)
    prompts = tiny_arch.prompts((150, 3, 60))
    want = [tiny_arch.hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    colocated = LLM(str(tmp_path), block_size=8).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in colocated] == want
    with LocalCluster(
        str(tmp_path),
        transport="inproc",
        prefill_args={"block_size": 16},
        decode_args={"block_size": 8},
    ) as c:
        outs = c.generate(prompts, GREEDY)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        assert [o.outputs[0].token_ids for o in outs] == want
        assert c.worker_stats()["D0"]["handoffs_received"] == len(prompts)
        assert_cluster_idle(c)
