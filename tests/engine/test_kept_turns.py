"""Conversation turns kept for their next turn (engine/kept_turns.py, KVCacheManager.keep_turn):
the TTL bookkeeping, the scheduler keeping a finished turn's prompt and answer, a follow-up
finding them, and memory pressure releasing them before any request waits or is preempted."""

from __future__ import annotations

import pytest

from factories import assert_no_leaks, make_request, make_scheduler, run_to_completion
from pdserve.engine.kept_turns import KeptTurns
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_turns_expire_in_order_at_their_ttl_and_a_next_turn_replaces_the_last() -> None:
    clock = Clock()
    kept: KeptTurns[int] = KeptTurns(10.0, clock)
    assert kept.keep("a", [1, 2]) == []
    clock.now = 4.0
    assert kept.keep("b", [3]) == []
    assert kept.hit("a") and not kept.hit("c")
    clock.now = 5.0
    assert kept.keep("a", [1, 2, 4]) == [1, 2]  # a's next turn: b is now the oldest
    clock.now = 13.9
    assert kept.expired() == []
    clock.now = 14.0
    assert kept.expired() == [3] and "b" not in kept and "a" in kept
    assert kept.pop_oldest() == [1, 2, 4] and kept.pop_oldest() is None
    s = kept.stats
    assert (s.kept, s.hits) == (3, 1)
    assert s.released == {"ttl": 1, "pressure": 1, "replaced": 1}


def test_a_negative_ttl_is_refused_and_zero_keeps_nothing() -> None:
    with pytest.raises(ValueError, match="conversation_ttl"):
        KeptTurns(-1.0, Clock())
    sched = make_scheduler(num_blocks=16, block_size=4)
    req = make_request(prompt_len=9, max_tokens=4)
    req.conversation = "c"
    sched.add_request(req)
    run_to_completion(sched)
    assert len(sched.kv.kept) == 0
    assert_no_leaks(sched)


def _keeping(num_blocks: int, clock: Clock) -> Scheduler:
    sched = make_scheduler(num_blocks=num_blocks, block_size=4)
    sched.kv.kept = KeptTurns(60.0, clock)
    return sched


def _turn(
    sched: Scheduler, prompt: list[int], max_tokens: int, conversation: str | None
) -> Request:
    req = make_request(prompt=prompt, max_tokens=max_tokens)
    req.conversation = conversation
    sched.add_request(req)
    run_to_completion(sched, token_fn=lambda r: 500 + r.num_tokens)
    return req


def test_a_finished_turns_prompt_and_answer_blocks_are_kept_for_the_follow_up() -> None:
    clock = Clock()
    sched = _keeping(32, clock)
    prompt = list(range(100, 110))  # 10 tokens; + 6 answered: 15 computed, 3 full blocks
    one = _turn(sched, prompt, 6, "conv")
    kv = sched.kv
    assert kv.num_kept_blocks == 3 and kv.num_free_blocks == kv.num_blocks - 3
    two = _turn(sched, [*prompt, *one.output_token_ids, 1, 2, 3], 2, "conv")
    assert two.num_cached_tokens == 12  # the answer's full blocks too
    assert kv.kept.stats.released["replaced"] == 1
    clock.now = 61.0
    kv.expire_kept()
    assert kv.kept.stats.released["ttl"] == 1 and kv.num_kept_blocks == 0
    assert_no_leaks(sched)


def test_memory_pressure_releases_kept_turns_before_preempting_or_waiting() -> None:
    clock = Clock()
    sched = _keeping(8, clock)  # 32 tokens
    _turn(sched, list(range(100, 112)), 5, "a")  # 16 computed: 4 blocks kept
    assert sched.kv.num_kept_blocks == 4
    _turn(sched, list(range(200, 224)), 6, None)  # 29 tokens: needs all 8 blocks
    assert sched.num_preemptions == 0
    assert sched.kv.kept.stats.released["pressure"] == 1 and len(sched.kv.kept) == 0
    assert_no_leaks(sched)
