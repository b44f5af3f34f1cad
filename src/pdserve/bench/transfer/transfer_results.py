"""What `pdserve bench transfer` measures and reports: its settings and targets, and one row
type per part (transport throughput, raw baselines, codec CPU cost, TTFT breakdown) gathered in
a `Report` (rendered by `transfer_report`)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.harness import report

# Shared by every module of the transfer bench.
DEFAULT_OUTPUT = Path("docs/benchmarks/transfer.md")
TRANSPORT_NAMES = ("tcp", "ipc", "shm", "inproc")
CODEC_NAMES = ("none", "int8", "int4")
BLOCK_SIZE = 16  # the receiver's paged cache: slots of shuffled 16-token blocks
SHM_MB = 512  # the shm ring, as a worker's default --shm-mb
SEED = 0
ACK_TIMEOUT_S = 300.0
CRC_MB = 64
NOISY_SPREAD = 1.3
TTFT_MAX_TOKENS = 4
TTFT_DEADLINE_S = 120.0  # a non-streaming hand-off is silent for the whole prefill

TARGET_RATIO = 0.70  # transport >= 70% of its raw baseline, codec none
TARGET_EXPOSED = 0.10  # exposed transfer <= 10% of TTFT ...
TARGET_EXPOSED_LEN = 2048  # ... at this prompt length, with streaming

# the raw socket baseline's own messages: (op, bytes) heads, then the bytes
OP_SETUP, OP_DATA, OP_STOP = 1, 2, 3
SOCK_HEAD = struct.Struct("<QQ")
BASELINE_OF = {"tcp": "tcp socket", "ipc": "unix socket", "shm": "memcpy x2", "inproc": "copy"}


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


@dataclass
class Layout:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * _itemsize(self.dtype)


@dataclass
class ThroughputRow:
    transport: str
    codec: str
    tokens: int
    frames: int
    raw_bytes: int
    wire_bytes: int
    seconds: float
    samples_s: list[float]
    effective_gbs: float
    wire_gbs: float
    baseline: str | None = None
    baseline_gbs: float | None = None
    ratio: float | None = None
    inline_frames: int = 0  # shm frames that did not fit the ring and went inline
    stages: dict[str, float] = field(default_factory=dict)  # median run: seconds, *_faults counts

    @property
    def spread(self) -> float:
        return max(self.samples_s) / min(self.samples_s)


@dataclass
class BaselineRow:
    kind: str  # "memcpy x2" | "copy" | "tcp socket" | "unix socket"
    tokens: int
    nbytes: int
    seconds: float
    samples_s: list[float]

    @property
    def gbs(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def spread(self) -> float:
        return max(self.samples_s) / min(self.samples_s)


@dataclass
class CodecRow:
    codec: str
    tokens: int
    raw_bytes: int
    wire_bytes: int
    encode_s: float
    decode_s: float

    @property
    def encode_gbs(self) -> float:
        return self.raw_bytes / self.encode_s / 1e9

    @property
    def decode_gbs(self) -> float:
        return self.raw_bytes / self.decode_s / 1e9


BREAKDOWN = ("queue", "prefill", "exposed", "first_decode", "ttft", "time_to_decode")


@dataclass
class TtftRow:
    transport: str
    stream_kv: bool
    prompt_tokens: int
    medians: dict[str, float]  # BREAKDOWN -> seconds
    exposed_pct: float | None  # median over requests of exposed / TTFT
    transfer_s: float | None  # median recv:done - send:ready: the whole transfer window
    kv_bytes: int  # frame bytes sent per request (P's report)
    samples: list[dict[str, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class Report(report.ReportHead):
    layout: Layout
    settings: dict[str, Any]
    throughput: list[ThroughputRow] = field(default_factory=list)
    baselines: list[BaselineRow] = field(default_factory=list)
    codecs: list[CodecRow] = field(default_factory=list)
    crc32_gbs: float | None = None
    ttft: list[TtftRow] = field(default_factory=list)
    targets: list[report.Target] = field(default_factory=list)
