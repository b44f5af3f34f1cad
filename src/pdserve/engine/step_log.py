"""The engine's last steps, as measured: when each began, how long it took, what it computed.

Why: a step-time model (`pdserve bench profile`) is measured minutes before it is used, and on a
shared VM the level of every step drifts 5-25% in that time (docs/benchmarks/sim.md). The steps a
worker really ran say how fast the machine was during a run; the simulator's validation prices
the same steps with the cost model and takes the ratio (sim/level.py `run_level`).

One entry per `LLMEngine.step()` that computed something: its start (`time.monotonic()`, one
clock for every process of a host, so two workers' steps can be tested for overlap), its wall
time (the whole `step()`, as the profiler times it), the decode rows (how many, their context
summed as the cost model prices it), each prompt chunk as (tokens, start position) and the
threads it ran on (`--adaptive` moves them between P and D; 0: not recorded). The wire form
(`to_wire`) leaves the threads out: a `Steps` message carries them in a list of its own.
Bounded: the oldest entries go first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.engine.scheduler import SchedulerOutput

MAX_STEPS = 8192


@dataclass(frozen=True)
class StepRecord:
    start: float  # time.monotonic() when the step began
    seconds: float
    decodes: int
    context: int  # sum over decode rows of (start position + 1)
    chunks: tuple[tuple[int, int], ...]  # prompt chunks: (tokens, start position)
    threads: int = 0  # the engine's threads during the step; 0: not recorded

    def to_wire(self) -> list[float]:
        """Flat, for a control message: start, seconds, decodes, context, n1, s1, n2, s2, ..."""
        flat: list[float] = [self.start, self.seconds, self.decodes, self.context]
        for n, s in self.chunks:
            flat += [n, s]
        return flat

    @classmethod
    def from_wire(cls, flat: list[float], threads: int = 0) -> StepRecord:
        if len(flat) < 4 or len(flat) % 2:
            raise ValueError(f"a step record has 4 + 2k numbers, got {len(flat)}")
        rest = [int(v) for v in flat[4:]]
        chunks = tuple(zip(rest[::2], rest[1::2], strict=True))
        return cls(float(flat[0]), float(flat[1]), int(flat[2]), int(flat[3]), chunks, threads)

    def overlaps(self, other: StepRecord) -> bool:
        return self.start < other.start + other.seconds and other.start < self.start + self.seconds


def from_wire(steps: list[list[float]], threads: list[int]) -> list[StepRecord]:
    """A `Steps` message's records; `threads` per step, or empty (not recorded)."""
    if threads and len(threads) != len(steps):
        raise ValueError(f"{len(steps)} steps but {len(threads)} thread counts")
    return [StepRecord.from_wire(s, threads[i] if threads else 0) for i, s in enumerate(steps)]


def record(out: SchedulerOutput, start: float, seconds: float, threads: int = 0) -> StepRecord:
    """What a scheduled step computed, split as the cost model prices it: a row of one token
    past position 0 is a decode, any other row a prompt chunk (the simulator's split too)."""
    decodes = context = 0
    chunks = []
    for s in out.scheduled:
        if s.num_tokens == 1 and s.start_pos > 0:
            decodes += 1
            context += s.start_pos + 1
        else:
            chunks.append((s.num_tokens, s.start_pos))
    return StepRecord(start, seconds, decodes, context, tuple(chunks), threads)


class StepLog:
    def __init__(self, maxlen: int = MAX_STEPS) -> None:
        self.steps: deque[StepRecord] = deque(maxlen=maxlen)

    def add(self, step: StepRecord) -> None:
        self.steps.append(step)

    def since(self, t: float) -> list[StepRecord]:
        """The kept steps that began at or after `t` (time.monotonic())."""
        return [s for s in self.steps if s.start >= t]

    def wire_since(self, t: float) -> tuple[list[list[float]], list[int]]:
        """`since(t)` as a `Steps` message carries it: the records' wire forms, their threads."""
        steps = self.since(t)
        return [s.to_wire() for s in steps], [s.threads for s in steps]
