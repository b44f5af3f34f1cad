"""`pdserve bench spec-drafts` (bench/spec_drafts.py): the offline walk over proposed drafts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.bench import spec_drafts as sd
from pdserve.bench.spec_drafts import Position


def test_positions_score_the_drafts_against_what_the_answer_went_on_to_say() -> None:
    # prompt "1 2 3 4 5"; the answer repeats it: after "1" the drafts are "2 3 4 5" (k 4)
    ps = sd.positions([1, 2, 3, 4, 5], [1, 2, 3, 9, 5], k=4, lo=1, hi=4)
    assert ps[0] == Position(span=0, drafted=0, accepted=0)  # "5" occurred nowhere before
    assert ps[1] == Position(span=1, drafted=4, accepted=2)  # after "1": 2 3 accepted, 4 != 9
    assert ps[2].accepted == 1 and ps[2].span == 2  # after "1 2": 3, then 4 != 9
    assert ps[3] == Position(span=3, drafted=4, accepted=0)  # "4" proposed, "9" written
    assert sd.positions([7, 8], [6], k=4, lo=1, hi=4) == [Position(0, 0, 0)]  # no match


def test_the_walk_prices_rows_and_skips_what_a_step_accepted() -> None:
    answer = [Position(3, 4, 2), Position(3, 4, 0), Position(3, 4, 0), Position(0, 0, 0)]
    # fixed 4: step 1 takes 3 tokens (2 drafts accepted) for 1 + 4r, then the last position
    w = sd.walk([answer], lambda p: 4, 0.25)
    assert w["tokens_per_step_time"] == pytest.approx(4 / (2.0 + 0.25 * 4))
    assert w["accepted_per_step"] == pytest.approx(1.0)
    # the oracle drafts what will be accepted: 3 tokens for 1.5, then 1 for 1
    assert sd.walk([answer], sd._oracle, 0.25)["tokens_per_step_time"] == pytest.approx(4 / 2.5)
    assert sd.walk([answer], lambda p: 0, 0.25)["tokens_per_step_time"] == 1.0


def test_classes_and_the_best_draft_count_per_class() -> None:
    answers = [[Position(1, 4, 0)] * 10 + [Position(12, 4, 3)] * 10]
    table = sd.class_table(answers, 4)
    assert table[0]["positions"] == 10 and table[0]["accepted_up_to"] == [0.0] * 4
    assert table[-1]["min_span"] == 9 and table[-1]["accepted_up_to"] == [1.0, 1.0, 1.0, 0.0]
    assert sd.best_by_class(table, 0.2) == [0, 0, 0, 0, 0, 3]
    result = sd.analyse(answers, 4, [0.2])
    walks = result["by_row_cost"][0]["walks"]
    assert walks["oracle"]["tokens_per_step_time"] >= walks["by class"]["tokens_per_step_time"]
    assert walks["by class"]["tokens_per_step_time"] >= max(
        walks[f"fixed {n}"]["tokens_per_step_time"] for n in range(5)
    )


@pytest.mark.slow
def test_the_command_writes_the_table_and_the_walks(tmp_path: Path) -> None:
    from pdserve import cli

    out = tmp_path / "drafts.json"
    argv = ["bench", "spec-drafts", "--num-requests", "2", "--input-len", "200"]
    assert cli.main([*argv, "--output-len", "12", "--row-cost", "0.1", "--json", str(out)]) == 0
    import json

    result = json.loads(out.read_text())
    assert [c["min_span"] for c in result["classes"]] == list(sd.SPANS)
    (block,) = result["by_row_cost"]
    assert block["row_cost"] == 0.1 and set(block["walks"]) >= {"fixed 0", "by class", "oracle"}
    assert block["walks"]["fixed 0"]["tokens_per_step_time"] == 1.0
    assert cli.main([*argv, "--row-cost", "-1"]) == 2  # a bad cost: a clear error, exit 2
