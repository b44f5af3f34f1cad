"""The simulator's speculative decoding and multi-turn reuse, on cases computed by hand with
the linear step model of test_sim (step = 1 s + 0.5 s per token or row)."""

from __future__ import annotations

import argparse
import itertools

import pytest
from test_sim import run

from pdserve.sim import cli as sim_cli
from pdserve.sim.deploy import summarize
from pdserve.sim.records import SimConfig, SimRequest
from pdserve.sim.spec import SpecDraws, SpecModel, expected_accepted
from pdserve.sim.workload import requests_from_items
from pdserve.workloads.streams import MultiTurnWorkload


def _one(spec: SpecModel | None, out: int = 5):  # type: ignore[no-untyped-def]
    cfg = SimConfig(colocated=1, spec=spec)
    sim, (r,) = run(cfg, [SimRequest("a", 0.0, [100, 101, 102, 103], out)])
    return sim.workers[0], r


def test_every_draft_accepted_by_hand() -> None:
    w, r = _one(SpecModel(2, 1.0))
    # prefill 4 tokens [0, 3]; decode with 2 drafts = 3 rows [3, 5.5]: 1 + 2 tokens; then 1
    # token left: no draft, [5.5, 7]
    assert r.first_at == pytest.approx(3.0) and r.finished_at == pytest.approx(7.0)
    assert r.tokens == 5 and r.tpot == pytest.approx(1.0)  # 1.5 without speculation
    assert (w.spec_steps, w.spec_drafted, w.spec_accepted) == (1, 2, 2)
    assert w.steps == 3


def test_rejected_drafts_still_cost_their_rows() -> None:
    w, r = _one(SpecModel(2, 0.0))
    # left 4, 3: 2 drafts (2.5 s); left 2: 1 draft (2 s); left 1: none (1.5 s)
    assert r.finished_at == pytest.approx(3.0 + 2.5 + 2.5 + 2.0 + 1.5)
    assert (w.spec_drafted, w.spec_accepted) == (5, 0) and r.tokens == 5
    _, plain = _one(None)
    assert plain.finished_at == pytest.approx(3.0 + 4 * 1.5)


def test_a_prefill_worker_does_not_speculate_and_d_does() -> None:
    cfg = SimConfig(prefill=1, decode=1, spec=SpecModel(3, 1.0))
    sim, (r,) = run(cfg, [SimRequest("a", 0.0, list(range(100, 120)), 9)])
    p, d = sim.workers
    assert p.spec_steps == 0 and d.spec_accepted > 0 and r.tokens == 9


def test_accepted_drafts_follow_the_truncated_geometric_law() -> None:
    assert expected_accepted(4, 0.5) == pytest.approx(0.5 + 0.25 + 0.125 + 0.0625)
    assert expected_accepted(3, 1.0) == 3 and expected_accepted(3, 0.0) == 0
    sampled = SpecDraws(SpecModel(4, 0.5, "sampled", seed=1))
    mean = sum(sampled.accepted("r", 4) for _ in range(20000)) / 20000
    assert mean == pytest.approx(0.9375, abs=0.05)  # standard error ~0.008
    expected = SpecDraws(SpecModel(4, 0.5, "expected"))
    counts = [expected.accepted("r", 4) for _ in range(16)]
    assert sum(counts) == 15 and set(counts) <= {0, 1, 2}  # 16 x 0.9375, no noise
    assert SpecModel(4, 0.5).drafts(3) == 2 and SpecModel(4, 0.5).drafts(1) == 0


def test_the_engine_s_pacer_stops_drafts_that_cost_more_than_they_yield() -> None:
    """Paced (`--spec-pacing`), each step's drafts are DraftPacer's cap: with every draft
    rejected, verify rows (0.5 s each here) stop being drafted but for its probes; with every
    draft accepted, the pacer keeps all four after the first plain step."""
    w, r = _one(SpecModel(4, 0.0, paced=True), out=40)
    unpaced, _ = _one(SpecModel(4, 0.0), out=40)
    assert w.spec_accepted == 0 and w.spec_drafted < unpaced.spec_drafted / 4
    _, plain = _one(None, out=40)
    assert r.finished_at < plain.finished_at + 0.5 * w.spec_drafted + 1e-9
    good, fast = _one(SpecModel(4, 1.0, paced=True), out=40)
    free, _ = _one(SpecModel(4, 1.0), out=40)
    assert good.spec_drafted >= free.spec_drafted - 4 and fast.finished_at < plain.finished_at
    assert sim_cli.spec_from_args(
        argparse.Namespace(spec_tokens=4, spec_acceptance=0.5, seed=0, spec_pacing=True)
    ).paced


def test_speculation_settings_are_checked() -> None:
    for bad in ((0, 0.5), (2, 1.5), (2, -0.1)):
        with pytest.raises(ValueError):
            SpecModel(*bad)
    with pytest.raises(ValueError, match="draw"):
        SpecModel(2, 0.5, "mean")
    ns = argparse.Namespace(spec_tokens=4, spec_acceptance=None, seed=0)
    with pytest.raises(ValueError, match="--spec-acceptance"):
        sim_cli.spec_from_args(ns)
    ns.spec_tokens, ns.spec_acceptance = 0, 0.5
    with pytest.raises(ValueError, match="--spec-tokens"):
        sim_cli.spec_from_args(ns)


# ---------------------------------------------------------------------------- multi-turn


def _conversation(reuse: bool):  # type: ignore[no-untyped-def]
    history = list(range(100, 140))  # 40 tokens
    answer = tuple(range(300, 309))  # 9 tokens: D computes 40 + 8 = 48 = 3 whole blocks
    turn0 = SimRequest("t0", 0.0, history, 9, conversation=0, answer=answer)
    turn1 = SimRequest("t1", 0.0, [*history, *answer, *range(500, 508)], 2, conversation=0,
                       turn=1)  # fmt: skip
    cfg = SimConfig(prefill=1, decode=1, multiturn_reuse=reuse)
    return run(cfg, [turn0, turn1])


def test_a_later_turn_runs_on_the_d_that_holds_its_history() -> None:
    sim, (r0, r1) = _conversation(reuse=True)
    assert r0.route == "remote" and r1.route == "reuse" and r1.workers == ("D0",)
    assert r1.cached_tokens == 48 and r1.kv_bytes == 0
    assert r1.ttft == pytest.approx(1 + 0.5 * 9)  # only the new message and the last token
    assert sim.counters["route_reuse"] == 1
    later = summarize([r0, r1], None, None, 2)["ttft_later_turns_s"]
    assert later["p50"] == pytest.approx(r1.ttft)  # turn 0 left out


def test_without_reuse_p_prefills_the_turn_and_sends_what_d_lacks() -> None:
    _, (_, r1) = _conversation(reuse=False)
    assert r1.route == "remote"
    # P has turn 0's prompt cached (2 blocks): computes 57 - 32 tokens; D has 48 of them
    assert r1.ttft == pytest.approx(1 + 0.5 * 25)
    assert r1.kv_bytes == (57 - 48) * 100


def test_each_turn_answers_with_what_the_next_prompt_carries() -> None:
    items = list(MultiTurnWorkload(6, 8, 4, 0.0, seed=0, turns=3))
    reqs = requests_from_items(items, [0.0] * len(items))
    for turn, nxt in itertools.pairwise(reqs):
        if nxt.turn == turn.turn + 1:
            n = len(turn.prompt)
            assert turn.answer == tuple(nxt.prompt[n : n + turn.max_tokens])
    assert reqs[2].answer == () and reqs[5].answer == ()  # the last turns


def test_threads_pick_the_cost_model_profiled_at_that_many() -> None:
    """`--threads 2` reads the file `bench profile --threads 2` writes (a colocated worker on two
    cores); without it one thread a worker, as before."""
    from pdserve.sim.deploy import Deployment, cost_model_path

    two = Deployment(hardware="cpu", model="default", colocated=1, threads=2)
    one = Deployment(hardware="cpu", model="default", colocated=1)
    assert cost_model_path(two).name.endswith("-t2.json")
    assert cost_model_path(one).name.endswith("-t1.json")
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    args = parser.parse_args(["--hardware", "cpu", "--colocated", "1", "--threads", "2"])
    assert sim_cli.deployment_from_args(args).threads == 2
