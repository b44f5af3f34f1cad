"""How much slower a worker's step runs while another worker on the same CPU host is mid-step.

`pdserve bench profile` times one worker alone; on a host whose workers share the cores (this
2-core machine runs P, D, the router and the client together) a decode step slows down while P
runs a prefill. `Contention` holds one measured slowdown per (own step kind, other's step kind):

    slowdown(kind, others) = table[kind][max over the others]  x  oversubscription
    oversubscription       = max(1, busy threads / cores) / max(1, 2 threads / cores)

`table[kind][other]` is median(step time with the other worker busy on `other` steps) /
median(step time alone), measured with two engines in two processes (`measure`, below); a
prefill among the others counts as the heavier neighbour. The oversubscription term extends the
two-worker measurement to more busy workers than the profile ran: when the busy workers'
threads exceed the cores, each thread gets cores / threads of a core (the profile's own
oversubscription is already in the table, so it is divided out).

Stored in the cost-model file (version 2 and later) as a "contention" section; a file without
one (every version-1 file) loads as `Contention.none()`: factor 1, `measured=False`, and `note`
says so.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

KINDS = ("prefill", "decode")


@dataclass(frozen=True)
class Contention:
    prefill_by_prefill: float = 1.0  # a prefill step while the other worker prefills
    prefill_by_decode: float = 1.0
    decode_by_prefill: float = 1.0  # a decode step while the other worker prefills
    decode_by_decode: float = 1.0
    threads: int = 1  # per worker, as profiled
    cores: int = 0  # the host's cores; 0: no oversubscription term
    measured: bool = True

    def __post_init__(self) -> None:
        for kind in KINDS:
            for other in KINDS:
                v = self.table(kind, other)
                if not v > 0:
                    raise ValueError(f"slowdown {kind}_by_{other} must be > 0, got {v}")
        if self.threads < 1 or self.cores < 0:
            raise ValueError("contention needs threads >= 1 and cores >= 0")

    @classmethod
    def none(cls) -> Contention:
        return cls(measured=False)

    @property
    def note(self) -> str:
        if not self.measured:
            return (
                "no contention profile in the cost model: workers sharing the host run at "
                "factor 1 (pdserve bench profile --contention measures it)"
            )
        return (
            f"contention (another worker mid-step): prefill x{self.prefill_by_decode:.2f} "
            f"beside a decode, x{self.prefill_by_prefill:.2f} beside a prefill; decode "
            f"x{self.decode_by_prefill:.2f} beside a prefill, x{self.decode_by_decode:.2f} "
            "beside a decode"
        )

    def table(self, kind: str, other: str) -> float:
        return float(getattr(self, f"{kind}_by_{other}"))

    def slowdown(self, kind: str, others: Sequence[str]) -> float:
        """The factor on a `kind` step while workers busy on `others` steps share the host."""
        if not others:
            return 1.0
        base = max(self.table(kind, o) for o in others)
        if not self.cores:
            return base
        busy = (len(others) + 1) * self.threads
        profiled = 2 * self.threads
        return base * max(1.0, busy / self.cores) / max(1.0, profiled / self.cores)

    # ---- fitting and storage ------------------------------------------------------------------
    @classmethod
    def fit(
        cls,
        alone: Mapping[str, Sequence[float]],
        together: Mapping[tuple[str, str], Sequence[float]],
        threads: int,
        cores: int,
    ) -> Contention:
        """From step times alone per kind and with a busy neighbour per (kind, other's kind)."""
        factors = {}
        for kind in KINDS:
            for other in KINDS:
                base, busy = alone.get(kind), together.get((kind, other))
                if not base or not busy:
                    raise ValueError(f"no {kind} samples alone or beside {other} steps")
                # a neighbour can only slow a step down; a lower median is noise
                factors[f"{kind}_by_{other}"] = max(
                    1.0, statistics.median(busy) / statistics.median(base)
                )
        f = factors
        return cls(
            f["prefill_by_prefill"], f["prefill_by_decode"], f["decode_by_prefill"],
            f["decode_by_decode"], threads, cores,
        )  # fmt: skip

    def save_into(self, path: Path) -> None:
        """Add this as the "contention" section of the cost-model file at `path`."""
        from pdserve.costmodel.model import VERSION

        body = json.loads(path.read_text())
        body["version"] = VERSION
        body["contention"] = asdict(self)
        path.write_text(json.dumps(body, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Contention:
        try:
            body = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read a cost model from {path}: {e}") from None
        section = body.get("contention") if isinstance(body, dict) else None
        if section is None:
            return cls.none()
        try:
            return cls(**{k: section[k] for k in asdict(cls())})
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: malformed contention section ({e})") from None


# --------------------------------------------------------------------------- measurement


@dataclass(frozen=True)
class Shapes:
    """The steps the concurrent profile times: one prompt, one decode batch."""

    prompt: int = 256
    batch: int = 4
    context: int = 256
    seconds: float = 3.0  # per phase, summed over the rounds
    # passes over the five phases: this host's step times drift by 10-15% over seconds, so
    # "alone" and "beside a neighbour" are each timed in every pass, seconds apart, rather
    # than once each in a different spell (one pass measured 1.10-1.16x where the serving run
    # right after showed 1.02-1.07x)
    rounds: int = 3


def measure(
    model: str | None, threads: int, shapes: Shapes = Shapes(), **engine_args: Any
) -> dict[str, Any]:
    """Two engines in two processes (`threads` each): A alone, then A and B busy together.

    Five phases, repeated `shapes.rounds` times, each `shapes.seconds / rounds` long: A
    prefills alone; A decodes alone; A prefills while B decodes; both prefill; both decode.
    Each worker loops its step for the phase and returns every step's time. Both start within
    a message of each other; the last step of a busy phase is dropped (it may end after the
    neighbour stopped). A busy phase lasts at least 4 lone steps of its slower kind (8 with
    one round). Returns the samples and the fitted `Contention`.
    """
    import multiprocessing as mp
    import os

    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    start = time.perf_counter()
    for name in ("A", "B"):
        parent, child = ctx.Pipe()
        args = (child, model, threads, shapes, engine_args)
        p = ctx.Process(target=_worker, args=args, name=f"contend-{name}")
        p.start()
        pipes.append(parent)
        procs.append(p)
    try:
        for pipe in pipes:
            _expect(pipe.recv(), "ready")
        alone: dict[str, list[float]] = {}
        together: dict[tuple[str, str], list[float]] = {}
        rounds = max(1, shapes.rounds)
        seconds, least = shapes.seconds / rounds, 8 if rounds == 1 else 4
        for _ in range(rounds):
            for kind in KINDS:
                alone.setdefault(kind, []).extend(_phase(pipes, [kind, None], seconds)[0])
            for a, b in (("prefill", "decode"), ("prefill", "prefill"), ("decode", "decode")):
                # long enough for a few of the slower step even at a 2x slowdown
                longest = max(statistics.median(alone[a]), statistics.median(alone[b]))
                ta, tb = _phase(pipes, [a, b], max(seconds, least * longest))
                together.setdefault((a, b), []).extend(ta[:-1] or ta)
                together.setdefault((b, a), []).extend(tb[:-1] or tb)
        for pipe in pipes:
            pipe.send(("stop", 0.0))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    fitted = Contention.fit(alone, together, threads, os.cpu_count() or 1)
    return {
        "alone": alone,
        "together": {f"{k}_by_{o}": v for (k, o), v in together.items()},
        "contention": fitted,
        "seconds": time.perf_counter() - start,
    }


def _expect(msg: Any, what: str) -> Any:
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise RuntimeError(f"contention profile worker failed: {msg[1]}")
    if what == "ready" and msg != "ready":
        raise RuntimeError(f"contention profile worker sent {msg!r}")
    return msg


def _phase(pipes: Sequence[Any], kinds: Sequence[str | None], seconds: float) -> list[list[float]]:
    busy = [(pipe, kind) for pipe, kind in zip(pipes, kinds, strict=True) if kind is not None]
    for pipe, kind in busy:
        pipe.send((kind, seconds))
    return [list(_expect(pipe.recv(), "times")) for pipe, _ in busy]


def _worker(conn: Any, model: str | None, threads: int, shapes: Shapes, engine_args: Any) -> None:
    try:
        loop = _Stepper(model, threads, shapes, engine_args)
        conn.send("ready")
        while True:
            kind, seconds = conn.recv()
            if kind == "stop":
                return
            conn.send(loop.run(kind, seconds))
    except Exception as e:  # the parent raises it with the worker's message
        conn.send(("error", f"{type(e).__name__}: {e}"))


class _Stepper:
    """One engine that loops prefill or decode steps of fixed shapes for a number of seconds."""

    def __init__(self, model: str | None, threads: int, shapes: Shapes, engine_args: Any) -> None:
        import torch

        from pdserve.costmodel import measure

        torch.set_num_threads(threads)
        grid = measure.Grid((shapes.prompt,), (), (), (shapes.batch,), (shapes.context,), 1, ())
        longest = max(shapes.prompt, shapes.context + 64)
        self.engine = measure.build_engine(model, threads, longest, grid, **engine_args)
        self.ids = measure.Ids(self.engine.arch.vocab_size)
        self.shapes = shapes
        self.run("prefill", 0.0)  # warm-up: each shape's first step allocates
        self.run("decode", 0.0)

    def run(self, kind: str, seconds: float) -> list[float]:
        from pdserve.costmodel import measure

        times: list[float] = []
        deadline = time.perf_counter() + seconds
        while not times or time.perf_counter() < deadline:
            if kind == "prefill":
                times.append(measure.prefill_step(self.engine, self.ids(self.shapes.prompt), 0))
            else:
                times.extend(self._decode(deadline))
        return times

    def _decode(self, deadline: float, steps: int = 32) -> list[float]:
        from pdserve.costmodel import measure

        s, engine = self.shapes, self.engine
        rids = measure.admit_decoding(engine, self.ids, s.batch, s.context, steps + 2)
        if rids is None:
            raise RuntimeError(f"a decode batch of {s.batch} x {s.context} does not fit")
        times: list[float] = []
        try:
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
                if time.perf_counter() >= deadline:
                    break
        finally:
            for rid in rids:
                engine.abort_request(rid)
        return times
