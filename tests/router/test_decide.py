"""The routing decision's pure parts (router/decide.py) and the typed worker report it reads
(router/worker_stats.py); tests/sim/test_routing_parity.py runs whole sequences through the
router and the simulator."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pdserve.costmodel.model import CostModel
from pdserve.router import decide, slo
from pdserve.router.loads import WorkerLoad
from pdserve.router.policies import make_policy
from pdserve.router.worker_stats import WorkerStats


@dataclass
class Worker:
    worker_id: str
    role: str
    outstanding: int = 0
    stats: WorkerStats = field(default_factory=WorkerStats)
    load: WorkerLoad = field(default_factory=lambda: WorkerLoad(""))


def test_a_report_parses_to_typed_fields_and_keeps_the_rest() -> None:
    report = {"waiting": 3, "running": 2.0, "prefill_tokens": 10, "quantization": "int8",
              "kv_pool_loaded_tokens": 5, "kv_pool": {"tiers": {}}, "gc_pauses": 1}  # fmt: skip
    s = WorkerStats.from_report(report)
    assert (s.waiting, s.running, s.prefill_tokens, s.quantization) == (3, 2, 10, "int8")
    assert s.report == report and s.report is not report  # a copy: the sender's dict may change
    assert s.kv_pool_use() == {"loaded_tokens": 5} and s.kv_pool_tiers() == {"tiers": {}}
    with pytest.raises(TypeError):
        s.report["waiting"] = 0  # type: ignore[index]


def test_a_value_of_the_wrong_type_counts_as_not_sent() -> None:
    s = WorkerStats.from_report({"waiting": "many", "prefill_tokens": True, "decode_matmul": 7})
    assert (s.waiting, s.prefill_tokens, s.decode_matmul) == (0, None, None)
    assert WorkerStats.from_report({}).prefill_tokens is None  # silence.py: nothing to judge


def test_pick_pairs_p_and_d_else_degrades_to_whole_requests() -> None:
    policies = {r: make_policy("least_outstanding") for r in decide.ROLES}
    p, d = Worker("P0", "prefill"), Worker("D0", "decode")
    busy, idle = Worker("D1", "decode", stats=WorkerStats(waiting=2)), Worker("D2", "decode")
    assert decide.pick({"prefill": [p], "decode": [d], "colocated": []}, policies) == (p, d)
    assert decide.pick({"prefill": [], "decode": [busy, idle], "colocated": []}, policies) == (
        idle,
        None,
    )  # the reported queue breaks the tie
    assert decide.pick({"prefill": [p], "decode": [], "colocated": []}, policies) == (p, None)
    assert decide.pick({r: [] for r in decide.ROLES}, policies) is None


def test_route_names() -> None:
    assert decide.route_kind("prefill", True, None, forced=False) == "remote"
    assert decide.route_kind("colocated", False, None, forced=False) == "colocated"
    assert decide.route_kind("decode", False, None, forced=False) == "fallback"
    assert decide.route_kind("decode", False, None, forced=True) == "recompute"
    assert decide.route_kind("prefill", False, None, forced=True) == "local"


def test_book_puts_prefill_on_p_and_the_decode_streams_on_d() -> None:
    planner = slo.SloPlanner(CostModel((0.0, 1e-3, 0.0), (0.01, 0.0, 0.0)), expected_output=50)
    p, d = WorkerLoad("P0"), WorkerLoad("D0")
    decide.book(planner, "r", (p, d), 100, 500, 1.0, None, pooled=40, streams=3)
    (pj,), (dj,) = p.jobs.values(), d.jobs.values()
    assert pj.prefill_s == pytest.approx(planner.prefill_time(100, 0, WorkerLoad(""), 40))
    assert not pj.decodes
    assert (dj.context, dj.remaining, dj.streams, dj.decodes) == (100, 50, 3, True)
    whole = WorkerLoad("C0")
    decide.book(planner, "w", (whole, None), 10, 0, 1.0, None)
    assert whole.jobs["w"].remaining == 1  # at least one token is expected


def test_n_choices_that_end_on_p_run_whole_on_d() -> None:
    assert decide.whole_on_decode(2, 1, None) and decide.whole_on_decode(2, 9, 0)
    assert not decide.whole_on_decode(1, 1, 5) and not decide.whole_on_decode(2, 9, None)


def test_history_tokens_are_the_whole_blocks_a_follow_up_shares_with_the_last_turn() -> None:
    last = list(range(10))  # a turn's prompt and answer: 9 tokens computed
    assert decide.history_tokens(last, [*last, 50, 51], 4) == 8
    assert decide.history_tokens(last, [0, 1, 2, 3, 4, 99, 6, 7, 8, 9, 10], 4) == 4
    assert decide.history_tokens(last, [7, *last], 4) == 0  # another conversation
    assert decide.history_tokens(last, last[:6], 4) == 4  # at least the last token is computed


@pytest.mark.parametrize(
    ("prompt_len", "cached", "local_tokens", "local"),
    [(120, 96, 32, True), (129, 96, 32, False), (120, 0, 512, False), (97, 96, 0, False)],
)
def test_a_follow_up_is_prefilled_on_its_d_when_few_tokens_are_new_there(
    prompt_len: int, cached: int, local_tokens: int, local: bool
) -> None:
    assert decide.follow_up_local(prompt_len, cached, local_tokens) is local
