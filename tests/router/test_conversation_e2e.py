"""Multi-turn conversations on a 1P1D inproc cluster (tiny model, no planner): where turn 2 is
prefilled and how much of its prompt each worker finds cached."""

from __future__ import annotations

from typing import Any

import pytest

from factories import assert_cluster_idle
from pdserve import LLM, SamplingParams
from pdserve.cluster import LocalCluster

BS = 16
ENGINE = {"block_size": BS}
ANSWER = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
TURN1 = [(i * 37) % 900 + 50 for i in range(70)]  # 4 full blocks and 6 tokens


@pytest.fixture(scope="module")
def ref(tiny_llama_path):  # type: ignore[no-untyped-def]
    return LLM(str(tiny_llama_path), **ENGINE)


def _cluster(path: object, **kw: Any) -> LocalCluster:
    return LocalCluster(str(path), transport="inproc", threads=1, engine_args=ENGINE, **kw)


def test_today_turn2_is_prefilled_on_p_and_d_skips_only_its_cached_blocks(
    tiny_llama_path, ref
) -> None:  # type: ignore[no-untyped-def]
    with _cluster(tiny_llama_path) as c:
        (one,) = c.generate([TURN1], ANSWER, user="conv-a")
        turn2 = [*TURN1, *one.outputs[0].token_ids, 5, 6, 7]
        before = c.worker_stats()
        (two,) = c.generate([turn2], ANSWER, user="conv-a")
        after = c.worker_stats()
        assert two.outputs[0].token_ids == ref.generate([turn2], ANSWER)[0].outputs[0].token_ids
        p_computed = after["P0"]["prefill_tokens"] - before["P0"]["prefill_tokens"]
        d_reused = after["D0"]["kv_tokens_reused"] - before["D0"]["kv_tokens_reused"]
        # P's prefix cache holds turn 1's prompt (4 blocks): it computes the answer again and
        # the new message; D holds turn 1's prompt and answer (6 blocks) and receives the rest
        assert p_computed == len(turn2) - 4 * BS
        assert d_reused == 6 * BS
        assert_cluster_idle(c)
