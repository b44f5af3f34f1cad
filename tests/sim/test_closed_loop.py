"""The simulator's closed loop (`pdserve sim --concurrency N --think-time S`): requests sent as
`bench serve --concurrency` sends them, on the linear step model of test_sim (step = 1 s +
0.5 s per token or row); and the open loop left as it was."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from test_sim import LinearStep

from pdserve.cli import main
from pdserve.sim.closedloop import ClosedLoop
from pdserve.sim.cluster import Simulation
from pdserve.sim.deploy import summarize
from pdserve.sim.records import Record, SimConfig, SimRequest
from pdserve.sim.steptime import Link
from pdserve.sim.workload import arrivals, requests_from_items
from pdserve.workloads.spec import think_times
from pdserve.workloads.streams import MultiTurnWorkload


def _conversations(
    n_requests: int, turns: int = 3, seed: int = 0, output_len: int = 4
) -> list[SimRequest]:
    items = list(MultiTurnWorkload(n_requests, 8, output_len, 0.2, seed=seed, turns=turns))
    return requests_from_items(items, [0.0] * len(items))  # the closed loop ignores arrivals


def _run(
    reqs: Sequence[SimRequest], load: ClosedLoop | None, cfg: SimConfig | None = None
) -> tuple[Simulation, list[Record]]:
    sim = Simulation(cfg or SimConfig(prefill=1, decode=1), LinearStep(), Link(1000.0, 0.25))
    records = sim.run(reqs, load=load)
    assert all(r.finished_at is not None or r.rejected for r in records)
    return sim, records


def _by_conv(reqs: Sequence[SimRequest], records: Sequence[Record]) -> dict[int, list[Record]]:
    out: dict[int, list[Record]] = {}
    for q, r in zip(reqs, records, strict=True):
        out.setdefault(q.conversation, []).append(r)
    return out


def _most_in_flight(records: Sequence[Record]) -> int:
    # an end and a send at the same instant: the end first (the send takes the freed slot)
    events = sorted([(r.arrival, 1) for r in records] + [(r.finished_at, -1) for r in records])
    level = most = 0
    for _, step in events:
        level += step
        most = max(most, level)
    return most


def test_at_most_concurrency_requests_and_conversations_in_flight() -> None:
    reqs = _conversations(15)  # 5 conversations of 3 turns
    _, records = _run(reqs, ClosedLoop(2, 0.3, "exponential"))
    assert _most_in_flight(records) == 2
    conv = {r.rid: q.conversation for q, r in zip(reqs, records, strict=True)}
    for x in records:  # the conversations with a turn in flight as each request is sent
        assert len({conv[r.rid] for r in records if r.arrival <= x.arrival < r.finished_at}) <= 2
    # as the load generator's queue: conversations 0 and 1 at t = 0, every first turn sent
    # before any later turn
    assert [r.rid for r in records if r.arrival == 0.0] == ["r0", "r3"]
    order = sorted(records, key=lambda r: r.arrival)
    assert [r.turn for r in order[:5]] == [0] * 5 and all(r.turn > 0 for r in order[5:])


@pytest.mark.parametrize("concurrency", [1, 2])
def test_a_later_turn_goes_its_think_time_after_the_previous_answer(concurrency: int) -> None:
    reqs = _conversations(6)  # 2 conversations of 3 turns
    _, records = _run(reqs, ClosedLoop(concurrency, 0.5, "fixed"))
    for turns in _by_conv(reqs, records).values():
        for prev, cur in itertools.pairwise(turns):
            assert prev.finished_at is not None
            if concurrency == 2:  # a slot is always free: exactly end + think
                assert cur.arrival == pytest.approx(prev.finished_at + 0.5)
            else:  # it may also wait for the other conversation's turn
                assert cur.arrival >= prev.finished_at + 0.5 - 1e-9


def _gaps(seed: int) -> list[float]:
    """End of a turn -> its next turn's send, in the order turns end."""
    reqs = _conversations(6)
    _, records = _run(reqs, ClosedLoop(2, 1.0, "exponential", seed=seed))
    pairs = [
        (prev.finished_at, cur.arrival - prev.finished_at)
        for turns in _by_conv(reqs, records).values()
        for prev, cur in itertools.pairwise(turns)
        if prev.finished_at is not None
    ]
    return [gap for _, gap in sorted(pairs)]


def test_seeded_exponential_think_times_are_the_load_generators_draws() -> None:
    gaps = _gaps(seed=3)
    assert gaps == _gaps(seed=3) and gaps != _gaps(seed=4)
    draw = think_times(1.0, "exponential", 3)
    assert draw is not None
    assert gaps == pytest.approx([draw() for _ in gaps])


def test_a_rejected_turn_frees_its_slot_and_its_next_turn_still_goes() -> None:
    # as bench serve: a refused turn ends at once, the next one is sent after the think time
    long_first = SimRequest("a0", 0.0, list(range(100, 150)), 2, conversation=0)
    follow = SimRequest("a1", 0.0, list(range(200, 210)), 2, conversation=0, turn=1)
    other = SimRequest("b0", 0.0, list(range(300, 310)), 2, conversation=1)
    cfg = SimConfig(prefill=1, decode=1, max_model_len=40)
    _, (a0, a1, b0) = _run([long_first, follow, other], ClosedLoop(1, 0.5, "fixed"), cfg)
    assert a0.rejected == "invalid_request" and a0.arrival == 0.0
    assert b0.arrival == 0.0  # the freed slot, at once
    assert b0.finished_at is not None and a1.rejected is None
    assert a1.arrival == pytest.approx(b0.finished_at)  # thought by 0.5, then the slot


def test_reuse_lowers_later_turns_ttft_in_the_closed_loop() -> None:
    # 16-token answers: every history fills a block on D (with 4, turn 2's would fill none:
    # D would cache none of it and the router would send it to P)
    reqs = _conversations(12, seed=1, output_len=16)
    p50 = {}
    for reuse in (True, False):
        cfg = SimConfig(prefill=1, decode=1, multiturn_reuse=reuse)
        sim, records = _run(reqs, ClosedLoop(2, 0.5), cfg)
        c = sim.counters
        assert c.get("route_reuse", 0) == c.get("multiturn_reuse_hits", 0) == (8 if reuse else 0)
        assert c.get("multiturn_history_lost", 0) == 0
        p50[reuse] = summarize(records, None, None, 2)["ttft_later_turns_s"]["p50"]
    assert p50[True] < p50[False]


def test_the_open_loop_is_unchanged() -> None:
    """Recorded before the closed loop existed: the same times and routes for a fixed seed.
    Re-recorded when follow-ups took the router's rule (sim/cluster.py `_follow`): each turn
    2's history (13-14 tokens) fills no whole block on D, so D caches none of it and the
    router sends it to P; turn 3 finds a block there and is prefilled on D."""
    items = list(MultiTurnWorkload(8, 8, 4, 0.2, seed=5, turns=3))
    reqs = requests_from_items(items, arrivals(len(items), 0.5, 5))
    _, records = _run(reqs, None)
    assert [r.route for r in records] == ["remote", "remote", "reuse"] * 2 + ["remote"] * 2
    times = [t for r in records for t in (r.arrival, r.first_at, r.finished_at)]
    assert times == pytest.approx(
        [0.0, 5.5, 9.65, 9.65, 27.966518, 37.816518, 37.816518, 49.316518, 55.816518,
         7.966518, 12.466518, 17.916518, 17.916518, 37.966518, 55.816518, 55.816518,
         65.816518, 72.316518, 12.209507, 27.966518, 39.316518, 39.316518, 50.316518,
         67.816518]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--think-time", "1"], "needs --concurrency"),
        (["--concurrency", "2", "--think-time", "inf"], "finite"),
        (["--concurrency", "2", "--trace", "t.csv"], "--trace"),
    ],
)
def test_bad_closed_loop_settings_are_clear_errors(argv: list[str], message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["sim", "--hardware", "h100", "--colocated", "1", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv", [["--concurrency", "0"], ["--think-time", "-1"], ["--think-dist", "gamma"]]
)
def test_bad_closed_loop_values_are_refused_by_argparse(argv: list[str], capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        main(["sim", *argv])
    assert "argument" in capsys.readouterr().err


def test_sim_cli_runs_the_closed_loop(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = (
        "sim --hardware h100 --prefill 1 --decode 1 --workload multiturn --turns 3 --input-len 64 "
        "--output-len 8 --num-requests 12 --concurrency 2 --think-time 0.1"
    )
    assert main(argv.split()) == 0
    out = capsys.readouterr().out
    assert "closed loop: 2 requests in flight, think time 0.1 s (exponential)" in out
    assert "TTFT of turns 2 and later" in out
