"""The scheduler with draft tokens (speculation): a decode's drafts ride in its chunk within
the budget, accepted ones advance it, rejected ones' blocks are freed and never registered,
and drafts never preempt anyone."""

from __future__ import annotations

from factories import assert_no_leaks, make_request, make_scheduler


def _decoding(s, prompt_len: int = 6, max_tokens: int = 20):  # type: ignore[no-untyped-def]
    r = make_request(prompt_len=prompt_len, max_tokens=max_tokens)
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {r.request_id: 1})
    return r


def test_drafts_ride_in_the_decode_chunk_within_the_budget() -> None:
    s = make_scheduler(block_size=4, budget=3)
    r = _decoding(s, prompt_len=3)
    r.spec_token_ids = [7, 8, 9, 10]
    (sr,) = s.schedule().scheduled
    assert sr.token_ids == [1, 7, 8] and sr.num_draft == 2 and sr.sample  # budget 3: 2 drafts
    assert sr.start_pos == 3
    s.abort_request(r.request_id)
    assert_no_leaks(s)


def test_accepted_drafts_advance_and_rejected_blocks_are_freed_unregistered() -> None:
    s = make_scheduler(block_size=4, budget=16)
    r = _decoding(s)  # 6 prompt tokens + 1: computed 6
    r.spec_token_ids = [7, 8, 9, 10, 11, 12]
    out = s.schedule()  # positions 6..12: blocks up to index 3 (4 blocks)
    assert len(s.kv.get_block_ids(r.request_id)) == 4
    s.update_from_output(out, {r.request_id: [7, 8, 5]})  # 2 accepted, then a correction
    assert r.output_token_ids == [1, 7, 8, 5]
    assert r.num_computed_tokens == 9 and r.num_tokens == 10 and r.spec_token_ids == []
    assert len(s.kv.get_block_ids(r.request_id)) == 3  # the 4th held only rejected drafts
    registered = [b for b in s.kv.pool.blocks if b.block_hash is not None]
    assert len(registered) == 1  # only the block full of real tokens (0..3) before this step
    s.abort_request(r.request_id)
    assert_no_leaks(s)


def test_a_stop_in_the_accepted_tokens_drops_the_rest() -> None:
    s = make_scheduler(block_size=4, budget=16)
    r = _decoding(s, max_tokens=3)
    r.spec_token_ids = [7, 8, 9]
    out = s.schedule()
    assert out.scheduled[0].num_draft == 3
    (done,) = s.update_from_output(out, {r.request_id: [7, 8, 9, 4]})
    assert done is r and r.output_token_ids == [1, 7, 8]  # max_tokens 3
    assert_no_leaks(s)


def test_drafts_never_preempt_another_request() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, budget=16)
    a, b = make_request(prompt_len=6, max_tokens=4), make_request(prompt_len=6, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    s.update_from_output(s.schedule(), {a.request_id: 1, b.request_id: 1})  # 2 blocks each: full
    b.spec_token_ids = [7, 8, 9]
    out = s.schedule()
    assert not out.preempted and [x.num_draft for x in out.scheduled] == [0, 0]
    assert s.num_draft_drops == 1
    for r in (a, b):
        s.abort_request(r.request_id)
    assert_no_leaks(s)
