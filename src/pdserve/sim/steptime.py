"""How long one engine step and one KV transfer take: the only thing the simulator invents.

A step is what `Scheduler.schedule()` returned: per request, `n` tokens computed from position
`start` (a prompt chunk, or one decode token). `StepModel.step_s(rows)` prices that batch.

* `CostModelStep`: this host, from the `CostModel` that `pdserve bench profile` fits. One fixed
  cost per step (the larger of the prefill and decode constants: one forward pass), the prefill
  terms per prompt chunk, the decode terms for the decoding rows:
      step = max(p0, D0) + sum_chunks (p1 n + p2 n (start + n/2) / 1000) + dec(b, ctx) - D0
  with dec = `CostModel.decode_step_s` (per-batch-size terms when profiled, else d0 + d1 b +
  d2 ctx / 1000) and D0 = dec(0, 0), its fixed part (the smallest batch's step, or d0).
  A hand-off's KV costs the receiving worker `CostModel.receive_s(tokens)` of its own time
  (`receive_s`; 0 for GPUs, whose NICs write into memory without the worker's compute).
* `RooflineStep`: a GPU instance of `tp` GPUs running a `ModelShape` in bf16:
      flops = 2 (layer weights) T + 2 (lm head) S + sum_rows 4 L H d n (start + n/2)
      bytes = weights + sum_rows KV bytes/token * (start + n)      (read the past, write the new)
      step  = max(flops / (tp F mfu), bytes / (tp B mbu)) + all-reduce + overhead
  T tokens in the step, S rows sampled, L layers, H heads of dimension d. A sliding layer
  (`ModelShape.layer_kinds`) attends to and reads at most its window's keys: its share of the
  attention and KV terms counts min(position + 1, window) keys per query. Tensor parallelism
  splits flops and bytes evenly over the GPUs and adds two all-reduces per layer of
  T x hidden x 2 bytes over NVLink (ring: 2 (tp - 1) / tp of the bytes), each with a latency.
* `Link`: KV bytes / bandwidth + a per-message cost, streamed layer by layer while the prefill
  computes (the simulator applies it per prompt chunk: see `Link.stream`).

`planner_cost_model` fits the router's `CostModel` (the SloPlanner's predictor) to a step model
with the same code the profiler uses (`CostModel.fit_relative`), so the simulated router predicts
from a fitted model, exactly as the real router does from the profiled one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.costmodel.model import CostModel
from pdserve.sim.hardware import GIB, Gpu, ModelShape

Row = tuple[int, int]  # (tokens computed this step, start position)


class StepModel(Protocol):
    @property
    def gpus(self) -> int:
        """GPUs (or worker slots) one instance occupies."""
        ...

    @property
    def kv_bytes_per_token(self) -> float: ...

    @property
    def layers(self) -> int: ...

    def step_s(self, rows: Sequence[Row]) -> float: ...

    def receive_s(self, tokens: int) -> float:
        """The receiving worker's own time to register a hand-off of `tokens` KV tokens."""
        ...

    def kv_tokens(self) -> int:
        """KV tokens one instance can hold."""
        ...


@dataclass(frozen=True)
class CostModelStep:
    model: CostModel
    kv_bytes_per_token: float = 0.0
    kv_cache_tokens: int = 65536
    layers: int = 30
    gpus: int = 1
    # the profiled model's sliding layers (sim/kv_groups.py), read from its architecture
    sliding_window: int | None = None
    layer_kinds: str = ""

    def step_s(self, rows: Sequence[Row]) -> float:
        batch = ctx = 0
        chunks = []
        for n, start in rows:
            if n == 1 and start > 0:
                batch += 1
                ctx += start + 1
            else:
                chunks.append((n, start))
        return self.priced(batch, ctx, chunks)

    def priced(self, batch: int, ctx: int, chunks: Sequence[Row]) -> float:
        """A step of `batch` decode rows over `ctx` context tokens in all and these prompt
        chunks (what `engine.step_log.StepRecord` keeps of a real step)."""
        p0, p1, p2 = self.model.prefill
        d0 = self.model.decode_step_s(0, 0)
        prefill = sum(p1 * n + p2 * n * (start + n / 2) / 1000 for n, start in chunks)
        decodes = self.model.decode_step_s(batch, ctx) - d0 if batch else 0.0
        fixed = max(p0 if chunks else 0.0, d0 if batch else 0.0)
        return fixed + prefill + decodes

    def receive_s(self, tokens: int) -> float:
        return self.model.receive_s(tokens)

    def kv_tokens(self) -> int:
        return self.kv_cache_tokens


@dataclass(frozen=True)
class RooflineStep:
    gpu: Gpu
    shape: ModelShape
    tp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.tp & (self.tp - 1):
            raise ValueError(f"tensor parallelism must be a power of two, got {self.tp}")
        if self.shape.kv_heads % self.tp and self.tp % self.shape.kv_heads:
            raise ValueError(f"{self.shape.name}: {self.shape.kv_heads} KV heads over tp={self.tp}")
        if self.kv_tokens() < 1:
            raise ValueError(
                f"{self.shape.name} ({self.shape.weight_bytes / 1e9:.0f} GB of weights) does not "
                f"fit on {self.tp} x {self.gpu.name}: raise tensor parallelism"
            )

    @property
    def gpus(self) -> int:
        return self.tp

    @property
    def layers(self) -> int:
        return self.shape.layers

    @property
    def kv_bytes_per_token(self) -> float:
        return float(self.shape.kv_bytes_per_token)

    @property
    def sliding_window(self) -> int | None:
        return self.shape.sliding_window

    @property
    def layer_kinds(self) -> str:
        return self.shape.layer_kinds

    def receive_s(self, tokens: int) -> float:
        return 0.0

    def kv_tokens(self) -> int:
        usable = self.tp * self.gpu.hbm_gib * GIB * self.gpu.memory_fraction
        return int((usable - self.shape.weight_bytes) // self.shape.kv_bytes_per_token)

    def step_s(self, rows: Sequence[Row]) -> float:
        s, g = self.shape, self.gpu
        tokens = sampled = 0
        attn = kv = 0.0
        for n, start in rows:
            tokens += n
            sampled += 1  # every row of a step samples except mid-prompt chunks; close enough
            attn += n * (start + n / 2)
            kv += start + n
        attn, kv = self._windowed(rows, attn, kv)
        flops = 2.0 * s.layers * s.active_layer_params * tokens + 2 * s.vocab * s.hidden * sampled
        flops += 4 * s.layers * s.heads * s.head_dim * attn
        nbytes = s.weight_bytes + kv * s.kv_bytes_per_token
        compute = flops / (self.tp * g.bf16_flops * g.mfu)
        memory = nbytes / (self.tp * g.hbm_bytes_s * g.mbu)
        return max(compute, memory) + self.allreduce_s(tokens) + g.step_overhead_s

    def _windowed(self, rows: Sequence[Row], attn: float, kv: float) -> tuple[float, float]:
        """`attn` (keys attended, summed over queries) and `kv` (keys read and written) of
        every layer, with the sliding layers' share counted over their window only: a query at
        position p sees min(p + 1, window) keys, a row reads min(start, window) + n. Unchanged
        when no layer slides."""
        kinds, window = self.shape.layer_kinds, self.shape.sliding_window
        if not kinds or window is None:
            return attn, kv
        share = kinds.count("s") / len(kinds)
        w_attn = w_kv = 0.0
        for n, start in rows:
            inside = min(n, max(0, window - start))  # queries before the window is full
            w_attn += inside * (start + inside / 2) + (n - inside) * window
            w_kv += min(start, window) + n
        return attn * (1 - share) + w_attn * share, kv * (1 - share) + w_kv * share

    def allreduce_s(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        per_call = tokens * self.shape.hidden * self.shape.dtype_bytes
        ring = 2 * (self.tp - 1) / self.tp * per_call / self.gpu.nvlink_bytes_s
        return 2 * self.shape.layers * (ring + self.gpu.allreduce_latency_s)


@dataclass
class Link:
    """A sender's network link: FIFO, `bytes_s` bandwidth, `per_message_s` per transfer."""

    bytes_s: float
    per_message_s: float = 0.0005
    free_at: float = 0.0
    bytes_sent: int = 0

    def __post_init__(self) -> None:
        if not self.bytes_s > 0:
            raise ValueError(f"link bandwidth must be > 0, got {self.bytes_s} bytes/s")
        if self.per_message_s < 0:
            raise ValueError("per-message cost must be >= 0")

    def stream(self, t0: float, dur: float, nbytes: float, layers: int, ready: float) -> float:
        """When the last byte of `nbytes` arrives, computed layer by layer in [t0, t0 + dur]
        and sent as each layer ends (not before `ready`: the receiver's reservation).

        Layer k of L is ready at t0 + k dur / L and takes b = nbytes / L / bandwidth; FIFO, the
        last one arrives at max over k of (ready_k + (L - k + 1) b), linear in k, so one of
        the ends: the link keeps up (t0 + dur + b) or it is the bottleneck (first layer's
        time, or when the link frees, + all bytes)."""
        if nbytes <= 0:
            return max(t0 + dur, ready)
        b = nbytes / layers / self.bytes_s
        start = max(self.free_at, t0 + dur / layers, ready)
        done = max(t0 + dur + b, start + nbytes / self.bytes_s, ready + b)
        self.free_at = done
        self.bytes_sent += int(nbytes)
        return done


def planner_cost_model(
    step: StepModel, max_prompt: int = 8192, link: Link | None = None
) -> CostModel:
    """The router's `CostModel` fitted to `step` on a grid of prompts and decode batches."""
    if isinstance(step, CostModelStep):
        return step.model
    prompts = [n for n in (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if n <= max_prompt]
    prefill = [(n, c, step.step_s([(n, c)])) for n in prompts for c in (0, n)]
    decode = []
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for ctx in (128, 512, 2048, 8192):
            decode.append((b, b * ctx, step.step_s([(1, ctx - 1)] * b)))
    transfer: tuple[tuple[int, float], ...] = ()
    if link is not None:
        transfer = tuple(
            (n, link.per_message_s + n / link.bytes_s) for n in (1 << 16, 1 << 20, 1 << 26)
        )
    # one linear decode fit, as before the per-batch terms: a roofline step is smooth in the
    # batch, and the published GPU results (docs/benchmarks/sim.md) were planned with it
    return CostModel.fit_relative(prefill, decode, transfer, by_batch=False)


def instance_kv_blocks(step: StepModel, block_size: int) -> int:
    """Blocks of every layer the instance's KV memory holds (a model with sliding layers
    splits the same memory into its KV groups: sim/kv_groups.py)."""
    return max(1, step.kv_tokens() // block_size)


def gbps_to_bytes_s(gbit_s: float) -> float:
    if not (gbit_s > 0 and math.isfinite(gbit_s)):
        raise ValueError(f"link speed must be a positive number of Gbit/s, got {gbit_s}")
    return gbit_s * 1e9 / 8
