"""`pdserve bench engine`'s vocabulary: the roofline, the model's cost per step, one result row
per measured point and the report; the constants every part of the benchmark shares. The
method and formulas are in `pdserve.bench.micro.engine_bench`."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.bench.harness import report

if TYPE_CHECKING:
    from pdserve.engine.models.arch import ModelArch

WARMUP_STEPS = 1  # decode steps run (untimed) between "all requests decoding" and the timing
MATMUL_N = 2048
BANDWIDTH_MIB = 1024  # well above the last-level cache (this 2-core VM has a 300 MiB L3)
SEED = 0
NOISY_SPREAD = 1.3  # rows whose repeats differ more than this are flagged as noisy


@dataclass
class Roofline:
    matmul_gflops: float  # 2 n^3 / time, n x n fp32 matmul
    read_gbs: float  # max(sum_gbs, matvec_gbs): the MBU reference
    sum_gbs: float  # torch.sum over a 1 GiB tensor: bytes read / time
    matvec_gbs: float  # 1 GiB matrix @ vector: matrix bytes / time
    copy_gbs: float  # 1 GiB tensor copy: (bytes read + bytes written) / time


@dataclass
class ModelCost:
    """FLOPs and bytes of one step, from the architecture alone (so HF and pdserve share it)."""

    layers: int
    heads: int
    head_dim: int
    kv_heads: int
    hidden: int
    vocab: int
    elem_size: int
    matmul_params: int  # non-embedding matmul weights: q, k, v, o, gate, up, down
    read_params: int  # weights read by a decode step: all but the embedding table, + LM head
    kv_elem_size: int = 0  # bytes per cached K or V element (--kv-cache-dtype); 0: elem_size

    @classmethod
    def from_arch(cls, arch: ModelArch, elem_size: int, kv_elem_size: int = 0) -> ModelCost:
        from pdserve.engine.models.checkpoint import expected_shapes

        numel = {name: math.prod(shape) for name, shape in expected_shapes(arch).items()}
        head = arch.vocab_size * arch.hidden_size
        body = sum(
            n for k, n in numel.items() if k not in ("model.embed_tokens.weight", "lm_head.weight")
        )
        return cls(
            layers=arch.num_layers,
            heads=arch.num_heads,
            head_dim=arch.head_dim,
            kv_heads=arch.num_kv_heads,
            hidden=arch.hidden_size,
            vocab=arch.vocab_size,
            elem_size=elem_size,
            matmul_params=sum(n for k, n in numel.items() if k.endswith("_proj.weight")),
            read_params=body + head,
            kv_elem_size=kv_elem_size or elem_size,
        )

    def prefill_flops(self, n: int) -> float:
        attention = 4 * self.layers * self.heads * self.head_dim * n * n / 2
        return 2.0 * self.matmul_params * n + attention + 2.0 * self.vocab * self.hidden

    def weight_bytes(self) -> int:
        return self.read_params * self.elem_size

    def kv_bytes(self, batch: int, context: float) -> float:
        elem = self.kv_elem_size or self.elem_size
        return batch * context * 2 * self.layers * self.kv_heads * self.head_dim * elem


@dataclass
class Row:
    phase: str  # "prefill" | "decode"
    size: int  # prompt length (prefill) or batch size (decode)
    seconds: float  # median time of the prefill step, or of one decode step
    tokens_per_s: float
    utilization: float  # MFU (prefill) or MBU (decode), as a fraction
    context: float  # prefill: n; decode: mean keys attended per timed step
    samples_s: list[float] = field(default_factory=list)
    quantization: str = "none"
    nominal_context: int = 0  # decode: C, the context the requests start from
    attention_share: float | None = None  # decode: time inside paged_attention / step time
    kv_read_s: float | None = None  # decode: the step's KV bytes / the measured read GB/s
    hf_seconds: float | None = None
    hf_tokens_per_s: float | None = None
    hf_samples_s: list[float] = field(default_factory=list)
    cpp_seconds: float | None = None
    cpp_tokens_per_s: float | None = None
    cpp_samples_s: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.phase == "prefill":
            return f"prefill {self.size}"
        return f"decode B={self.size} C={self.nominal_context}"

    @property
    def ratio(self) -> float | None:
        """pdserve's speed over transformers' (see paired_ratio)."""
        return paired_ratio(
            self.samples_s, self.hf_samples_s, self.tokens_per_s, self.hf_tokens_per_s
        )

    @property
    def cpp_ratio(self) -> float | None:
        return paired_ratio(
            self.samples_s, self.cpp_samples_s, self.tokens_per_s, self.cpp_tokens_per_s
        )

    @property
    def spread(self) -> float:
        """Largest max/min over the timed repeats of any side: > NOISY_SPREAD is suspect."""
        sides = (self.samples_s, self.hf_samples_s, self.cpp_samples_s)
        return max((max(s) / min(s) for s in sides if s), default=1.0)


def paired_ratio(
    mine: list[float], theirs: list[float], speed: float, their_speed: float | None
) -> float | None:
    """How many times faster pdserve ran than a peer: with both sides' samples (seconds for the
    same work, sample i of each taken in round i: side by side), the median of the rounds'
    ratios; else the ratio of the median speeds (tokens/s); None without the peer."""
    if mine and len(mine) == len(theirs):
        return statistics.median(t / m for m, t in zip(mine, theirs, strict=True))
    return None if not their_speed else speed / their_speed


@dataclass
class Report(report.ReportHead):
    model: dict[str, Any]
    settings: dict[str, Any]
    roofline: Roofline
    rows: list[Row]
    targets: list[report.Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context: int  # C: tokens of KV each request starts from
    steps: int


# What a system measures: ("prefill", prompt length) or ("decode", point).
Key = tuple[str, int] | tuple[str, DecodePoint]


def key_label(key: Key) -> str:
    """The label of the row a key's samples belong to (Row.label)."""
    what = key[1]
    if isinstance(what, DecodePoint):
        return f"decode B={what.batch} C={what.context}"
    return f"prefill {what}"


class System(Protocol):
    """One side of the comparison (a pdserve variant, transformers, llama.cpp): its points,
    and one timed sample of a point (seconds per prefill, or per decode step)."""

    name: str
    keys: list[Key]

    def once(self, key: Key) -> float: ...
