"""A conversation's follow-up in the simulator goes where the router sends it
(router/routing.py `follow`): to the D that decoded the previous turn, prefilled there when at
most --conversation-local-tokens of its prompt are not in that D's prefix cache, else on P (the
history lost, counted). On the linear step model of test_sim (step = 1 s + 0.5 s per token)."""

from __future__ import annotations

import pytest
from test_sim import LinearStep, run

from pdserve.cli import main
from pdserve.sim.records import SimConfig, SimRequest

HISTORY = list(range(100, 140))  # 40 tokens
ANSWER = tuple(range(300, 309))  # 9 tokens: D computes 40 + 8 = 48 = 3 whole blocks


def _turns(new: int, then: float = 0.0) -> list[SimRequest]:
    """A turn, and its follow-up at `then` (or when the turn ends) carrying the answer and
    `new` more tokens."""
    turn0 = SimRequest("t0", 0.0, HISTORY, 9, conversation=0, answer=ANSWER)
    follow = [*HISTORY, *ANSWER, *range(500, 500 + new)]
    return [turn0, SimRequest("t1", then, follow, 2, conversation=0, turn=1)]


def _multiturn(sim) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    c = sim.counters
    return c.get("multiturn_reuse_hits", 0), c.get("multiturn_history_lost", 0)


def test_a_cached_history_and_a_short_new_part_prefill_on_d() -> None:
    sim, (r0, r1) = run(SimConfig(prefill=1, decode=1), _turns(8))
    assert r0.route == "remote" and r1.route == "reuse" and r1.workers == ("D0",)
    assert r1.cached_tokens == 48 and r1.kv_bytes == 0
    assert _multiturn(sim) == (1, 0)
    kept = sim.byid["D0"].kv.kept.stats  # D kept turn 0 for it (engine/kept_turns.py)
    assert kept.kept == 2 and kept.hits == 1 and kept.released["replaced"] == 1


def test_a_new_part_over_the_local_limit_goes_to_p() -> None:
    cfg = SimConfig(prefill=1, decode=1, conversation_local_tokens=8)
    sim, (_, r1) = run(cfg, _turns(8))  # 57 - 48 = 9 tokens not on D: over 8
    assert r1.route == "remote" and r1.workers == ("P0", "D0")
    assert r1.kv_bytes == (57 - 48) * 100  # P sends only the blocks D lacks
    assert _multiturn(sim) == (0, 1)
    sim, (_, r1) = run(cfg, _turns(7))  # 8 tokens: prefilled on D
    assert r1.route == "reuse" and _multiturn(sim) == (1, 0)


def test_an_evicted_history_goes_to_p_and_is_counted() -> None:
    # D holds 6 blocks (96 tokens): another conversation's 80-token prompt takes them all, so
    # D releases the kept turn (memory pressure) and evicts its blocks
    other = SimRequest("o0", 30.0, list(range(700, 780)), 2, conversation=1)
    cfg = SimConfig(prefill=1, decode=1)
    sim, records = run(cfg, [*_turns(8, then=90.0), other], step=LinearStep(tokens=96))
    _, r1, o0 = records
    assert o0.finished_at is not None and o0.finished_at < r1.arrival
    assert r1.route == "remote" and r1.workers == ("P0", "D0")
    assert _multiturn(sim) == (0, 1)
    assert sim.byid["D0"].kv.kept.stats.released["pressure"] >= 1  # turn 0's, then o0's
    # without the other conversation the same follow-up finds its history on D
    sim, (_, r1) = run(cfg, _turns(8, then=90.0), step=LinearStep(tokens=96))
    assert r1.route == "reuse" and _multiturn(sim) == (1, 0)


def test_the_ttl_releases_a_kept_turn_whose_blocks_stay_cached() -> None:
    # as the engine: past --conversation-ttl the turn is no longer kept, its blocks cached
    # until evicted, so the router still finds the history on D
    cfg = SimConfig(prefill=1, decode=1, conversation_ttl_s=5.0)
    sim, (_, r1) = run(cfg, _turns(8, then=100.0))
    assert sim.byid["D0"].kv.kept.stats.released["ttl"] == 1
    assert r1.route == "reuse" and r1.cached_tokens == 48
    with pytest.raises(ValueError, match="conversation_ttl_s"):
        SimConfig(prefill=1, decode=1, conversation_ttl_s=-1.0)


def test_without_reuse_nothing_is_kept_or_counted() -> None:
    sim, (_, r1) = run(SimConfig(prefill=1, decode=1, multiturn_reuse=False), _turns(8))
    assert r1.route == "remote" and _multiturn(sim) == (0, 0)
    assert sim.byid["D0"].kv.kept.stats.kept == 0


def test_the_cli_flags_and_the_counts_in_the_output(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["sim", "--hardware", "h100", "--prefill", "1", "--decode", "1", "--workload",
            "multiturn", "--turns", "3", "--first-len", "64", "--input-len", "16",
            "--output-len", "8", "--num-requests", "6", "--rate", "0.5"]  # fmt: skip
    assert main([*argv, "--conversation-local-tokens", "0", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"history_lost": 4' in out and '"reuse_hits": 0' in out
    assert main([*argv, "--conversation-ttl", "30"]) == 0
    assert "later turns: 4 prefilled on the D holding their history" in capsys.readouterr().out
