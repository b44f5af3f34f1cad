"""The prefill weight format: prompt rows on the CPU's matrix units, decode rows on packed 4-bit.

Prefill is compute-bound and decode bandwidth-bound, so each phase gets its own copy of the
projection weights (`--prefill-format`):
  * decode rows (one query token each) run the decode format: `--quantization`, by default the
    GGUF file's own 4-bit blocks (the fewest bytes to stream per step);
  * prompt rows run bfloat16 copies of the same weights through torch's oneDNN GEMM, which
    issues AMX tile instructions (or AVX-512 BF16 dot products) where the CPU has them, and
    their attention runs torch's blocked (flash) SDPA in bfloat16: no float32 T x T scores.
The residual stream, norms, RoPE and the KV written to the cache stay float32 (the cache's own
dtype after that), so D continues from P's KV exactly as from its own.

Which engine holds what follows its phases (`ModelConfig.phases`, set from a worker's role):
a P worker holds the prefill format (its decode copies are freed after the start-up probe), a
D worker the decode format only, a colocated worker both (prompt rows and decode rows of one
step split between them, `PhaseProjection`). The LM head stays in the decode format
everywhere: it runs on sampled rows only.

`auto` picks bf16 only for a quantized decode format (float32 weights, `--quantization none`,
stay exact unless bf16 is asked for), where the CPU has bf16 matrix instructions (AMX or AVX-512
BF16: on an AVX2-only CPU torch emulates bfloat16, far slower than the int16 kernels) and a
start-up probe on layer 0's gate|up projection at PROBE_ROWS rows measures it faster than the
decode format by at least MIN_SPEEDUP. The choice, the probe's figures and the extra memory are
logged and reported in the engine's stats (/admin/workers, /metrics).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from pdserve.engine import kernels
from pdserve.engine.linear.bf16 import AmxKernel, AMXLinear, BF16Linear, amx_kernel, bf16_kernel
from pdserve.engine.linear.float32 import FloatLinear
from pdserve.engine.linear.phases import PromptWeights, StepRows
from pdserve.engine.quantize import LAYER_PROJECTIONS, layers_of

if TYPE_CHECKING:
    from pdserve.engine.models.arch import ModelArch
    from pdserve.engine.models.llama import LlamaLayer, LlamaModel

log = logging.getLogger(__name__)

PROBE_ROWS = 512  # rows of the start-up probe: a prompt chunk's size, well into compute-bound
MIN_SPEEDUP = 1.2  # auto keeps the decode format unless bf16 beats it by this much


@dataclass(frozen=True)
class MatrixUnits:
    """The CPU's bfloat16 matrix instructions, from its feature flags (a fake in tests)."""

    amx_bf16: bool
    avx512_bf16: bool

    @classmethod
    def from_flags(cls, flags: frozenset[str]) -> MatrixUnits:
        return cls(amx_bf16="amx_bf16" in flags, avx512_bf16="avx512_bf16" in flags)

    @property
    def isa(self) -> str:
        """What oneDNN's bfloat16 GEMM runs on here: amx | avx512_bf16 | none (emulated)."""
        return "amx" if self.amx_bf16 else "avx512_bf16" if self.avx512_bf16 else "none"


def probe_units() -> MatrixUnits:
    return MatrixUnits.from_flags(kernels.cpu_flags())


@dataclass(frozen=True)
class PrefillChoice:
    """What `--prefill-format` came to for this engine, and why (logged, in stats)."""

    format: str  # bf16 | bf16x3 | none
    isa: str  # the matrix instructions bf16 runs on: amx | avx512_bf16 | none
    reason: str
    probe_ms: tuple[float, float] | None = None  # (decode format, bf16) at PROBE_ROWS rows
    extra_bytes: int = 0  # memory the bf16 copies add beside the decode format


def wanted(
    name: str,
    phases: str,
    quantization: str,
    device: torch.device,
    dtype: torch.dtype,
    units: MatrixUnits,
    shapes: tuple[int, ...] = (),
) -> tuple[str, str]:
    """The decision before the weights load: (format to build: bf16 | bf16x3 | none, why).
    `auto` builds bf16x3 where the CPU has AMX; `bf16` alone agrees less with float32 than the
    4-bit decode format does (docs/benchmarks/prefill.md), so it is only made when asked for."""
    if name == "none":
        return "none", "--prefill-format none"
    if device.type != "cpu" or dtype != torch.float32:
        if name != "auto":
            raise ValueError(
                f"--prefill-format {name} runs beside a float32 model on the CPU; "
                f"this engine is {str(dtype).removeprefix('torch.')} on {device.type}"
            )
        return "none", f"model on {device.type} in {dtype}"
    if name == "bf16x3" and not units.amx_bf16:
        raise ValueError(
            "--prefill-format bf16x3 runs on AMX tiles, which this CPU lacks; "
            "use bf16 (less agreement with float32) or none"
        )
    if phases == "decode":
        return "none", "a decode worker holds the decode format only"
    odd = [n for n in shapes if n % 32]
    if name == "bf16x3" and odd:
        raise ValueError(
            f"--prefill-format bf16x3 needs projection sizes in multiples of 32: {odd}"
        )
    if name != "auto":
        return name, "asked for"
    if quantization == "none":
        return "none", "float32 weights stay exact unless a prefill format is asked for"
    if not units.amx_bf16:
        return "none", "no AMX on this CPU (bf16x3 needs it; plain bf16 agrees less)"
    if odd:
        return "none", f"projection sizes {odd} are not multiples of 32 (AMX tiles)"
    return "bf16x3", "auto"


def resolved(name: str, quantization: str, dtype: str = "float32", device: str = "cpu") -> str:
    """What a colocated engine's `--prefill-format name` comes to on this CPU before the probe
    (bf16x3 | bf16 | none): what cost-model files are named and measured by."""
    dt = getattr(torch, dtype)
    return wanted(name, "both", quantization, torch.device(device), dt, probe_units())[0]


class PhaseProjection:
    """One projection in two formats: a step's decode rows on `decode`, its prompt rows on
    `prefill` (one call each; a step of one kind makes one call). `decode` None: every row on
    the prefill format (a P worker, which freed its decode copies)."""

    def __init__(self, decode: Callable | None, prefill: Callable, rows: StepRows) -> None:
        self.decode, self.prefill, self.rows = decode, prefill, rows

    @property
    def nbytes(self) -> int:
        own = int(getattr(self.prefill, "nbytes", 0))
        return own + (int(getattr(self.decode, "nbytes", 0)) if self.decode is not None else 0)

    @property
    def decode_nbytes(self) -> int:
        """Bytes a decode step reads: the decode format's only (the prefill copies stay idle)."""
        return int(getattr(self.decode if self.decode is not None else self.prefill, "nbytes", 0))

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """The MLP's activation fused into this gate|up projection's GEMM, when every row of
        the step runs a prefill format that fuses it (AMXLinear); None: project, then act."""
        whole = self.decode is None or self.rows.first_prompt_row == 0
        fused = getattr(self.prefill, "silu_mul", None)
        return fused(x) if whole and fused is not None else None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        split = self.rows.first_prompt_row if self.decode is not None else 0
        t = x.shape[0]
        if split == 0:
            return self.prefill(x, residual)
        assert self.decode is not None
        if split >= t:
            return self.decode(x, residual)
        head = None if residual is None else residual[:split]
        tail = None if residual is None else residual[split:]
        return torch.cat((self.decode(x[:split], head), self.prefill(x[split:], tail)))


def probe(decode: Callable, prefill: Callable, in_features: int) -> tuple[float, float]:
    """Milliseconds of one call of each format on PROBE_ROWS random rows (best of 3, warm)."""
    x = torch.randn(PROBE_ROWS, in_features)

    def best(f: Callable) -> float:
        f(x)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            f(x)
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3

    return best(decode), best(prefill)


# (layer, projection) -> its prefill-format copy
Copies = dict[tuple[int, str], "BF16Linear | AMXLinear"]


def projection_sizes(arch: ModelArch) -> tuple[int, ...]:
    """The K and N of every layer projection (bf16x3's tiles take multiples of 32)."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return (arch.hidden_size, arch.intermediate_size, q, q + 2 * kv)


def make_copies(model: LlamaModel, kind: str) -> Copies:
    """`kind` (bf16 | bf16x3) copies of every layer projection, made from the float weights
    before quantization frees them (a GGUF file's blocks dequantized exactly, then rounded)."""
    make = AMXLinear if kind == "bf16x3" else BF16Linear
    copies: Copies = {}
    for i, layer in enumerate(layers_of(model)):
        for proj in LAYER_PROJECTIONS:
            bias = layer.qkv_bias if proj == "qkv" else None
            copies[(i, proj)] = make(getattr(layer, proj), bias)
    return copies


def attach(
    model: LlamaModel,
    copies: Copies,
    name: str,
    phases: str,
    units: MatrixUnits,
    measure: Callable[[Callable, Callable, int], tuple[float, float]] | None = None,
) -> PrefillChoice:
    """Probe (`measure`, default `probe`; for `auto`, the decision) and put the copies in place
    beside (or, phases `prefill`, instead of) the decode format; the choice as made."""
    layers = layers_of(model)
    kind = "bf16x3" if isinstance(copies[(0, "qkv")], AMXLinear) else "bf16"
    decode = {
        (i, proj): layer.quantized.get(proj) or _float_projection(layer, proj)
        for i, layer in enumerate(layers)
        for proj in LAYER_PROJECTIONS
    }
    timing = (measure or probe)(
        decode[(0, "gate_up")], copies[(0, "gate_up")], model.arch.hidden_size
    )
    speedup = timing[0] / timing[1]
    isa = "amx" if kind == "bf16x3" else units.isa
    if name == "auto" and speedup < MIN_SPEEDUP:
        why = f"{kind} measured {speedup:.2f}x the decode format at {PROBE_ROWS} rows"
        return PrefillChoice("none", isa, why, timing)
    rows = StepRows(has_decode_format=phases == "both")
    rows.prompt_dtype = torch.bfloat16 if kind == "bf16" else None
    rows.prompt_attention = prompt_attention(kind, units)
    extra = sum(c.nbytes for c in copies.values())
    for (i, proj), copy in copies.items():
        keep = decode[(i, proj)] if phases == "both" else None
        layers[i].quantized[proj] = PhaseProjection(keep, copy, rows)
        if keep is None:  # a P worker: the decode copy goes (the float one too)
            extra -= int(getattr(decode[(i, proj)], "nbytes", 0))
            weight = getattr(layers[i], proj)
            weight.data = weight.data.new_empty(0)
    model.step_rows = rows
    if kind == "bf16":  # bfloat16 from GEMM to GEMM in steps of prompt rows only
        ops = bf16_kernel()
        for i, layer in enumerate(layers):
            mine = {proj: cast(BF16Linear, copies[(i, proj)]) for proj in LAYER_PROJECTIONS}
            layer.prompt_weights = PromptWeights(rows, mine, ops)
    how = "asked for" if name != "auto" else f"measured {speedup:.2f}x the decode format"
    return PrefillChoice(kind, isa, f"{how} at {PROBE_ROWS} rows", timing, extra)


def prompt_attention(kind: str, units: MatrixUnits) -> Callable[..., torch.Tensor] | None:
    """Prompt rows' causal attention on AMX tiles (kernels/amx.cpp; head_dim 64, no window cut
    or soft cap): bf16x3 scores for bf16x3; for bf16 one bfloat16 product, as its GEMMs round,
    which beats torch's bfloat16 SDPA and its conversions (1.5x at 2048 tokens, 4-5x at 512, on
    the 1B shape's heads on 2 Xeon cores) and returns float32. None: torch's SDPA in bfloat16."""
    if kind == "bf16x3":
        return amx_kernel().causal_attention
    kernel = _amx_or_none(units, "bf16 prompt attention")
    return None if kernel is None else functools.partial(kernel.causal_attention, split=False)


def _amx_or_none(units: MatrixUnits, what: str) -> AmxKernel | None:
    """The AMX kernels where the CPU has them and Linux hands this process the tile state."""
    if not (units.amx_bf16 and kernels.amx_supported()):
        return None
    try:
        return amx_kernel()
    except RuntimeError as e:  # Linux refused this process the tile state
        log.warning("%s on torch's SDPA, not AMX tiles: %s", what, e)
        return None


def decode_rows_attention(
    name: str, choice: PrefillChoice, quantization: str, device: torch.device,
    dtype: torch.dtype, units: MatrixUnits,
) -> Callable[..., torch.Tensor] | None:  # fmt: skip
    """Causal attention for prompt rows that run on the decode format (a decode worker's own
    prefills: a conversation's follow-up over its kept history, a burst under `--adaptive`; a
    colocated step's few prompt rows): bf16x3's AMX kernel, float32-level agreement, where the
    prefill format would be bf16x3 (auto or asked for) and the CPU has AMX. A 48-token follow-up
    over 1,848 cached tokens on one Xeon thread: 3.9 ms a layer on float32 SDPA pieces. None:
    SDPA (no AMX, float32 weights kept exact, or another format asked for)."""
    if name not in ("auto", "bf16x3") or choice.format not in ("none", "bf16x3"):
        return None
    if device.type != "cpu" or dtype != torch.float32 or quantization == "none":
        return None
    kernel = _amx_or_none(units, "decode-format prompt rows' attention")
    return None if kernel is None else kernel.causal_attention


def _float_projection(layer: LlamaLayer, proj: str) -> FloatLinear:
    return FloatLinear(getattr(layer, proj), layer.qkv_bias if proj == "qkv" else None)


def stats(choice: PrefillChoice, rows: StepRows | None) -> dict[str, object]:
    """The engine stats' prefill fields (/admin/workers, /metrics)."""
    out: dict[str, object] = {
        "prefill_format": choice.format,
        "prefill_isa": choice.isa,
        "prefill_format_reason": choice.reason,
        "prefill_extra_bytes": choice.extra_bytes,
    }
    if choice.probe_ms is not None:
        out["prefill_probe_speedup"] = round(choice.probe_ms[0] / choice.probe_ms[1], 3)
    if rows is not None:
        out["prompt_rows_prefill_format"] = rows.prompt_rows_run
        out["prompt_rows_decode_format"] = rows.prompt_rows_decode_format
    return out


def log_choice(choice: PrefillChoice, quantization: str, phases: str) -> None:
    """The start-up line that says which format each phase runs, why, and what memory it adds."""
    timing = ""
    if choice.probe_ms is not None:
        decode_ms, bf16_ms = choice.probe_ms
        timing = f"; probe {decode_ms:.1f} ms decode format vs {bf16_ms:.1f} ms {choice.format}"
    if choice.format == "none":
        log.info("prefill format none (%s): prompts run %s%s", choice.reason, quantization, timing)
        return
    mb = choice.extra_bytes / 2**20
    decode = "no decode format (a P worker)" if phases == "prefill" else f"decode {quantization}"
    log.info(
        "prefill format %s on %s (%s%s); %s; its copies %+.0f MB",
        choice.format, choice.isa, choice.reason, timing, decode, mb,
    )  # fmt: skip
