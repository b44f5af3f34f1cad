"""How fast this host runs now against a profiled cost model: a few engine steps, timed.

A shared VM's speed drifts by more than a simulation's targets: on the Xeon AMX (model 167) the
same 2048-token bf16 prefill on 2 threads took 0.53 s in one hour's profile and 1.18 s three
hours later (docs/benchmarks/adaptive.md). A sweep simulated with a profile from another phase
of the host predicts another machine. `measure` rebuilds the engine a cost model is profiled
for (model, threads and the settings it is named after: serve/plan.py `cost_settings`) in a
subprocess, so that its threads are gone before a server starts, and times

    prefill: a fresh PREFILL_TOKENS-token prompt, the median of REPEATS steps
    decode:  DECODE_BATCH requests at DECODE_CONTEXT tokens each, the median of DECODE_STEPS

against the model's price of the same steps (the simulator's price of them: sim/steptime.py):
`prefill_x` and `decode_x`, measured / priced, what `CostModel.rescaled` takes. `bench sweep
--sim` measures it before each point of a pdserve system and predicts the point at that level
beside the profile's (bench/sweep_sim.py). About 10 s a probe, most of it loading the model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.costmodel.model import CostModel

PREFILL_TOKENS = 512
DECODE_BATCH = 8
DECODE_CONTEXT = 512
REPEATS = 3
DECODE_STEPS = 8
TIMEOUT_S = 300.0
SETTINGS = ("quantization", "kv_cache_dtype", "decode_matmul", "prefill_format")


@dataclass(frozen=True)
class Level:
    prefill_x: float  # measured / priced prefill step
    decode_x: float
    prefill_s: float  # the measured steps
    decode_s: float
    decode_context: int  # the decode step's summed context, as priced
    seconds: float  # the probe's wall time, the model's loading included

    def __post_init__(self) -> None:
        if not (self.prefill_x > 0 and self.decode_x > 0):
            raise ValueError(f"level factors must be > 0, got {self.prefill_x}, {self.decode_x}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def level_of(model: CostModel, prefill_s: float, decode_s: float, context: int,
             seconds: float = 0.0) -> Level:  # fmt: skip
    """The factors of measured step times against `model`'s price of the probe's shapes (the
    simulator's price of a lone prefill or decode step is the same: sim/steptime.py)."""
    priced_prefill = model.prefill_s(PREFILL_TOKENS)
    priced_decode = model.decode_step_s(DECODE_BATCH, context)
    return Level(prefill_s / priced_prefill, decode_s / priced_decode, prefill_s, decode_s,
                 context, seconds)  # fmt: skip


def save_rescaled(profile: Path, model: CostModel, out: Path, **about: object) -> Path:
    """`model` (a rescaled `profile`) saved to `out` with the profile's `about` under `about`
    and its contention section, so that whatever loads `out` prices as `profile` would at
    the new level."""
    from pdserve.costmodel.contention import Contention

    model.save(out, **{**CostModel.load_about(profile), **about})
    contention = Contention.load(profile)
    if contention.measured:
        contention.save_into(out)
    return out


def measure(cost_model: Path, model: str | None, threads: int,
            settings: Mapping[str, str]) -> Level:  # fmt: skip
    """Time the probe's steps now (a subprocess) and compare them with `cost_model`."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    cmd = [sys.executable, "-m", "pdserve.costmodel.host_level", "--threads", str(threads)]
    cmd += ["--model", model] if model else []
    for key in SETTINGS:
        if key in settings:
            cmd += [f"--{key.replace('_', '-')}", str(settings[key])]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-3:]
        raise RuntimeError(f"host level probe failed ({done.returncode}): {' | '.join(tail)}")
    timed = json.loads(done.stdout.strip().splitlines()[-1])
    return level_of(CostModel.load(cost_model), timed["prefill_s"], timed["decode_s"],
                    timed["decode_context"], time.perf_counter() - t0)  # fmt: skip


def time_steps(model: str | None, threads: int, settings: Mapping[str, str]) -> dict[str, Any]:
    """The probe's steps on an engine built as `bench profile` builds it (in this process)."""
    import torch

    from pdserve.costmodel import measure as m

    torch.set_num_threads(threads)
    engine = m.build_engine(model, threads, PREFILL_TOKENS, m.FULL, **settings)
    ids = m.Ids(engine.arch.vocab_size)
    m.warm_up(engine, ids)
    prefill = statistics.median(m.prefill_step(engine, ids(PREFILL_TOKENS), 0)
                                for _ in range(REPEATS))  # fmt: skip
    got = m.decode_times(engine, ids, DECODE_BATCH, DECODE_CONTEXT, DECODE_STEPS)
    if got is None:
        raise RuntimeError(f"a decode batch of {DECODE_BATCH} x {DECODE_CONTEXT} does not fit")
    times, contexts = got
    return {"prefill_s": prefill, "decode_s": statistics.median(times),
            "decode_context": round(statistics.mean(contexts))}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="time the host-level probe's steps; JSON on stdout")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--model", default=None)
    for key in SETTINGS:
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, default="auto")
    args = p.parse_args(argv)
    settings = {k: getattr(args, k) for k in SETTINGS}
    print(json.dumps(time_steps(args.model, args.threads, settings)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
