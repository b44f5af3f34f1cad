"""The engine's step log (engine/step_log.py): a step split as the cost model prices it, bounded."""

from __future__ import annotations

from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from pdserve.engine.step_log import StepLog, StepRecord, record


def test_a_mixed_step_splits_into_decodes_and_prompt_chunks() -> None:
    out = SchedulerOutput(
        [
            ScheduledRequest("d1", [5], 99, [0], True),  # decode at position 99: 100 tokens
            ScheduledRequest("d2", [6], 9, [1], True),  # 10 tokens
            ScheduledRequest("p1", [1, 2, 3], 0, [2], True),  # a whole 3-token prompt
            ScheduledRequest("p2", [4] * 8, 16, [3], False),  # a later chunk of a prompt
            ScheduledRequest("one", [7], 0, [4], True),  # a 1-token prompt is a chunk
        ]
    )
    got = record(out, 5.0, 0.25)
    assert got == StepRecord(5.0, 0.25, 2, 110, ((3, 0), (8, 16), (1, 0)))


def test_the_log_keeps_the_newest_steps_and_filters_by_start() -> None:
    log = StepLog(maxlen=3)
    for i in range(5):
        log.add(StepRecord(float(i), 0.5, 1, 10, ()))
    assert [s.start for s in log.since(0.0)] == [2.0, 3.0, 4.0]
    assert [s.start for s in log.since(3.0)] == [3.0, 4.0]
