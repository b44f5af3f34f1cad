"""Multi-turn conversations on a 1P1D inproc cluster (tiny model, no planner): a short follow-up
is prefilled on the D that kept the previous turn (prompt and answer), a long one on P, which
loads the history from the KV pool; an evicted history is prefilled again and counted."""

from __future__ import annotations

from typing import Any

import pytest

from factories import assert_cluster_idle
from pdserve import LLM, SamplingParams
from pdserve.cluster import LocalCluster
from pdserve.kvpool.api import FakeKVPool, KVPoolConfig, PoolNamespace
from pdserve.kvpool.values import value_nbytes
from pdserve.router import timeline as tl

BS = 16
ENGINE = {"block_size": BS}
ANSWER = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
TURN1 = [(i * 37) % 900 + 50 for i in range(70)]  # 4 full blocks and 6 tokens
HISTORY = 6 * BS  # turn 1's KV: 70 + 40 - 1 tokens, 6 full blocks


@pytest.fixture(scope="module")
def ref(tiny_llama_path):  # type: ignore[no-untyped-def]
    return LLM(str(tiny_llama_path), **ENGINE)


def _cluster(path: object, **kw: Any) -> LocalCluster:
    return LocalCluster(str(path), transport="inproc", threads=1, engine_args=ENGINE, **kw)


def _labels(out: Any, ev: tl.Ev) -> list[tuple[str, str]]:
    return [(e.split(": ", 1)[1], w) for e, w, _ in out.timeline if tl.kind_of(e) == ev]


def _turns(c: LocalCluster, ref: LLM, new: list[int], user: str = "conv-a") -> tuple[Any, Any]:
    (one,) = c.generate([TURN1], ANSWER, user=user)
    turn2 = [*TURN1, *one.outputs[0].token_ids, *new]
    (two,) = c.generate([turn2], ANSWER, user=user)
    assert two.outputs[0].token_ids == ref.generate([turn2], ANSWER)[0].outputs[0].token_ids
    return one, two


def test_short_follow_up_is_prefilled_on_d_with_its_history_cached(tiny_llama_path, ref) -> None:  # type: ignore[no-untyped-def]
    with _cluster(tiny_llama_path) as c:
        _, two = _turns(c, ref, [5, 6, 7])
        assert _labels(two, tl.Ev.ROUTE) == [("local", "D0")]
        assert ("96 tokens", "D0") in _labels(two, tl.Ev.CACHED)
        assert _labels(two, tl.Ev.CONVERSATION) == [(f"hit {HISTORY} tokens", "D0")]
        d = c.worker_stats()["D0"]
        assert d["conversation_turns_kept"] == 2 and d["conversation_hits"] == 1
        assert d["conversation_released_replaced"] == 1 and d["kv_blocks_kept"] > 0
        assert c.stats["conversation_hit"] == 1
        assert_cluster_idle(c)


def test_evicted_history_is_prefilled_again_and_counted(tiny_llama_path, ref) -> None:  # type: ignore[no-untyped-def]
    # D holds 12 blocks: another prompt of 150 tokens (10 blocks) pushes the kept turn out
    with _cluster(tiny_llama_path, decode_args={"num_blocks": 12}) as c:
        (one,) = c.generate([TURN1], ANSWER, user="conv-a")
        other = [(i * 53) % 900 + 60 for i in range(150)]
        c.generate([other], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert c.worker_stats()["D0"]["conversation_released_pressure"] == 1
        turn2 = [*TURN1, *one.outputs[0].token_ids, 5, 6, 7]
        (two,) = c.generate([turn2], ANSWER, user="conv-a")
        assert two.outputs[0].token_ids == ref.generate([turn2], ANSWER)[0].outputs[0].token_ids
        assert c.stats["conversation_miss"] == 1 and c.stats["conversation_hit"] == 0
        (miss,) = _labels(two, tl.Ev.CONVERSATION)
        assert miss[0].startswith("miss ") and miss[0].endswith(f" of {HISTORY} tokens")
        assert_cluster_idle(c)


class SharedPool:
    """Every inproc worker gets the same in-process fake pool."""

    def __init__(self) -> None:
        self.pool: FakeKVPool | None = None

    def __call__(self, config: KVPoolConfig, ns: PoolNamespace) -> FakeKVPool:
        self.pool = self.pool or FakeKVPool(ns)
        return self.pool


def test_long_follow_up_goes_to_p_which_loads_the_history_from_the_pool(
    tiny_llama_path, ref
) -> None:  # type: ignore[no-untyped-def]
    eng = ref.engine
    k = eng.cache.layers[0][0]
    shape = (len(eng.cache.layers), 2, BS, k.shape[2], k.shape[3])
    chunk_mb = 2 * value_nbytes(48, shape, eng.dtype, "none") / (1 << 20)  # 2-block chunks
    with _cluster(
        tiny_llama_path,
        pool_factory=SharedPool(),
        kv_pool={"kv_pool_chunk_mb": chunk_mb},
        core_args={"conversation_local_tokens": 16},
    ) as c:
        before = c.worker_stats()["P0"]["prefill_tokens"]
        new = [(i * 11) % 900 + 70 for i in range(40)]
        _, two = _turns(c, ref, new)
        assert _labels(two, tl.Ev.ROUTE) == [("remote", "P0->D0")]
        computed = c.worker_stats()["P0"]["prefill_tokens"] - before
        # P had turn 1's prompt (4 blocks) and loaded the answer's 2 blocks that D put in the pool
        assert computed - len(TURN1) == len(two.prompt_token_ids) - HISTORY
        assert ("32 of 32 tokens", "P0") in _labels(two, tl.Ev.POOL_LOAD)
        assert (f"{HISTORY} tokens", "D0") in _labels(two, tl.Ev.CACHED)  # D received the rest
        assert _labels(two, tl.Ev.CONVERSATION) == [(f"hit {HISTORY} tokens", "D0")]
        assert_cluster_idle(c)
