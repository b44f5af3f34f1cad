"""Configuration: frozen dataclasses, one per concern, each field with a default and a help string.

The CLI is generated from these (`add_config_args`), read back (`config_from_args`) and, for a
child process, written as argv again (`config_argv`); `EngineConfig.from_kwargs` maps the flat
keyword arguments of `LLM(**engine_args)` onto them, so a name means the same thing everywhere.
One object per process kind: `EngineConfig` (the engine), `WorkerConfig` (a worker process,
beside its role, id and engine arguments) and `RouterConfig` (the router core). A new knob is
one field here: its flag, its default, its help and its argv come with it.
Validation raises `ValueError` saying what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from pdserve.spec_config import parse_speculative_config

# Weight quantizations (engine/quantize.py picks them; named here so config needs no torch).
QUANTIZATIONS = ("auto", "none", "int8", "w8g32", "w8a8", "gguf", "gguf-a8", "gguf-a16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# How matmuls of a few rows (decode steps) run on float32 weights (engine/quantize.py).
DECODE_MATMULS = ("auto", "tiles", "torch")
# Prompt rows' weight format (engine/prefill_format.py) and which phases' formats an engine holds.
PREFILL_FORMATS = ("auto", "bf16x3", "bf16", "none")
PHASES = ("both", "prefill", "decode")


# Quantizations whose `--kv-cache-dtype auto` is float16 rather than the model's float32. Measured
# (docs/benchmarks/quant.md, 60 prompts x 64 tokens): w8g32 with a float16 cache agrees with
# float32 on 66.1% of tokens against 66.2% with a float32 one, mean KL +0.7%, while the KV read
# is up to half a decode step at 2k context. w8a8 lost 8 points of agreement with it (54.3% ->
# 46.4%, below llama.cpp Q4_1's 49.3%; KL +2.7%), so it keeps float32 unless asked. gguf (the
# file's own weights: 60/60 outputs equal to float32's) with a float16 cache: 59/60, 98.4%, KL
# 3.0e-7 (the float16 cache's own cost: float32 weights over it measured the same), a tenth of
# w8g32's agreement loss at a ten-thousandth of its KL, for half the KV bytes per token. gguf-a8
# (the file's weights, int8 activations): 55.0% / KL 1.80e-3 with float16 against 52.6% / 1.87e-3
# with float32 (the activations' rounding dominates). gguf-a16 (int16 activations): as gguf.
FLOAT16_KV_QUANTIZATIONS = ("w8g32", "gguf", "gguf-a8", "gguf-a16")


def cache_dir() -> Path:
    """Where pdserve keeps what it derives once and reuses (cost models, tokenizers converted
    from GGUF): $PDSERVE_CACHE_DIR if set, else ~/.cache/pdserve."""
    root = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "pdserve"


def resolve_kv_cache_dtype(kv_cache_dtype: str, quantization: str, dtype: str = "float32") -> str:
    """The KV cache's element type for these settings: `auto` is the model's dtype, float16
    under the quantizations of FLOAT16_KV_QUANTIZATIONS (float32 models, CPU only)."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return "float16" if quantization in FLOAT16_KV_QUANTIZATIONS and dtype == "float32" else dtype


def cost_kv_cache_dtype(kv_cache_dtype: str, quantization: str, dtype: str = "float32") -> str:
    """The KV dtype a cost model is named and checked by: `auto` when the cache holds the model's
    dtype, else that narrower dtype (`w8g32` with `auto` and with `float16` are one measurement)."""
    resolved = resolve_kv_cache_dtype(kv_cache_dtype, quantization, dtype)
    return "auto" if resolved == dtype else resolved


def check_quantization(name: str) -> None:
    """The name alone; what the model, dtype and device can take is checked at engine start."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {name!r}")


def _f(default: Any, help: str, flag: str | None = None, cli: bool = True) -> Any:
    """A field with its help; `flag` when the CLI spells it otherwise (`--deadline` for
    `deadline_s`); `cli=False` for a knob only code sets."""
    return field(default=default, metadata={"help": help, "flag": flag, "cli": cli})


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = _f(
        None, "HF folder (config.json + *.safetensors) or .gguf file; default: SmolLM2-135M"
    )
    dtype: str = _f("float32", "weights and activations: float32 | bfloat16 | float16")
    quantization: str = _f(
        "auto",
        "projection weights: auto (gguf-a16 for a GGUF file of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 "
        "/ Q4_K / Q5_K / Q6_K weights on an AVX2 CPU in float32, else none: a file in another "
        "format runs as float32 under a warning) | none (as --dtype) | int8 (int8 per output "
        "channel, int8 activations per token) | w8g32 (int8 weights, one scale per 32 inputs "
        "per output channel, float32 activations) | w8a8 (the same weights, activations int8 "
        "with one scale per 32 inputs, integer dot products) | gguf (a GGUF file's own Q4_1 / "
        "Q8_0 weights as stored, float32 activations) | gguf-a8 (the same weights, w8a8's int8 "
        "activations) | gguf-a16 (the same weights, int16 activations per 32 inputs; the "
        "K-quants, Q4_0 and Q5_x run under gguf-a16 only); quantized: CPU, float32 only",
    )
    decode_matmul: str = _f(
        "auto",
        "float32 projections at <= 64 rows (decode steps): tiles (a second copy of the weights "
        "in 16-channel tiles, streamed by a native kernel: on CPU 2-4x torch's GEMM at 2-16 "
        "rows) | torch (torch's GEMM only) | auto (tiles for float32 weights on an AVX2 CPU)",
    )
    prefill_format: str = _f(
        "auto",
        "prompt rows' projections: bf16x3 (AMX tiles, three bfloat16 products a projection: "
        "float32's agreement) | bf16 (bfloat16 copies on torch's oneDNN GEMM, AMX or AVX-512 "
        "BF16, and bfloat16 attention: fastest, agrees less with float32) | none (the decode "
        "format, as --quantization) | auto (bf16x3 for a quantized decode format on a CPU with "
        "AMX where it measures faster at start-up, else none)",
    )
    phases: str = _f(
        "both",
        "which phases' weight formats this engine holds: both (colocated: prompt rows on the "
        "prefill format, decode rows on the decode format) | prefill (a P worker) | decode (a D "
        "worker); a worker sets it from its role",
        cli=False,
    )
    device: str = _f("cpu", "torch device: cpu | cuda | cuda:N")
    max_model_len: int | None = _f(None, "context cap in tokens; default: the model's own")
    seed: int = _f(0, "seed for requests that do not set their own")

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        check_quantization(self.quantization)
        if self.decode_matmul not in DECODE_MATMULS:
            raise ValueError(
                f"decode_matmul must be one of {', '.join(DECODE_MATMULS)}, "
                f"got {self.decode_matmul!r}"
            )
        if self.prefill_format not in PREFILL_FORMATS:
            raise ValueError(
                f"prefill_format must be one of {', '.join(PREFILL_FORMATS)}, "
                f"got {self.prefill_format!r}"
            )
        if self.phases not in PHASES:
            raise ValueError(f"phases must be one of {', '.join(PHASES)}, got {self.phases!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _f(16, "tokens per KV block")
    num_blocks: int | None = _f(
        None,
        "KV blocks; default: derived from kv_cache_memory_gb (a model mixing sliding and global "
        "layers splits the memory of this many blocks between its two KV groups)",
    )
    kv_cache_memory_gb: float = _f(1.0, "memory for the KV cache when num_blocks is not set")
    enable_prefix_caching: bool = _f(True, "reuse KV of shared prompt prefixes")
    conversation_ttl: float = _f(
        60.0,
        "seconds a worker keeps a finished conversation turn's KV (prompt and answer) for the "
        "next turn, released earlier when memory is needed; 0: not kept",
    )
    kv_cache_dtype: str = _f(
        "auto",
        "element type of the KV cache: auto (the model's --dtype; float16 under --quantization "
        "w8g32) | float32 | float16 | bfloat16 (under float32: half the bytes per "
        "token, so twice the blocks per GB and half the KV read per decode step; attention "
        "still computes in float32)",
    )
    attention: str = _f(
        "auto",
        "how attention reads the KV cache: paged (in place, native CPU kernel) | gather "
        "(copy the blocks, then SDPA: the reference) | auto (paged on CPU, gather on CUDA)",
    )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.attention not in ("auto", "paged", "gather"):
            raise ValueError(f"attention must be auto, paged or gather, got {self.attention!r}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be > 0")
        if not self.conversation_ttl >= 0:
            raise ValueError("conversation_ttl must be >= 0 seconds (0: off)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = _f(2048, "token budget of one engine step")
    max_num_seqs: int = _f(64, "cap on running requests")
    enable_chunked_prefill: bool = _f(True, "split long prompts across steps")
    decode_first: bool = _f(True, "schedule running decodes before new prompts each step")
    speculative_config: str | None = _f(
        None,
        "speculative decoding on decoding workers (never on P), vLLM's JSON: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 1}\' (docs/speculation.md); a dict from Python',
    )

    def __post_init__(self) -> None:
        spec = parse_speculative_config(self.speculative_config)  # any error names its key
        if spec is not None:  # one spelling, so it travels to worker processes as a flag
            object.__setattr__(self, "speculative_config", spec.to_json())
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")


@dataclass(frozen=True)
class ParallelConfig:
    threads: int | None = _f(None, "torch intra-op threads; default: torch's choice")

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")


_SECTIONS = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat names (`block_size=32`, `dtype="bfloat16"`, ...)."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        owner = {f.name: sec for sec, c in _SECTIONS.items() for f in dataclasses.fields(c)}
        for key, value in kwargs.items():
            if key not in owner:
                raise ValueError(
                    f"unknown engine argument {key!r}; accepted: {', '.join(sorted(owner))}"
                )
            parts[owner[key]][key] = value
        return cls(**{sec: _SECTIONS[sec](**vals) for sec, vals in parts.items()})


@dataclass(frozen=True)
class WorkerConfig:
    """A worker process's own knobs (its role, id and engine arguments travel beside them)."""

    host: str = _f("127.0.0.1", "interface to bind (loopback)")
    port: int = _f(0, "control port; 0 picks a free one (fixed: a restart keeps its address)")
    kv_port: int = _f(0, "KV port; 0 picks a free one")
    transport: str = _f("tcp", "KV transport: tcp | ipc | shm | inproc")
    kv_codec: str = _f("none", "KV wire codec: none | int8 | int4")
    deadline_s: float = _f(5.0, "seconds of silence before a hand-off fails", "--deadline")
    lease_s: float = _f(10.0, "seconds P keeps sent KV waiting for D's acknowledgement", "--lease")
    kv_wait_s: float = _f(
        30.0, "seconds D holds blocks reserved for a hand-off before its first KV frame (P may "
        "be computing the prompts queued ahead; the router's stuck check covers a P that never "
        "starts)", "--kv-wait",
    )  # fmt: skip
    cpus: str | None = _f(None, "pin to these CPUs, e.g. 0 or 0,1")
    stream_kv: bool = _f(
        True, "stream each layer's KV while the prompt computes (default) or send it all after"
    )
    shm_mb: int = _f(512, "shared-memory ring of the shm transport, MiB")
    slo_tpot_s: float | None = _f(
        None,
        "TPOT SLO, seconds: size each step's prompt tokens so running decodes stay within it "
        "(stall-free batching; needs --cost-model)",
        "--slo-tpot",
    )
    cost_model: str | None = _f(None, "cost model JSON (pdserve bench profile) for --slo-tpot")
    # The KV pool (issue 15): every tier is off unless its flag is given.
    kv_pool_memory_gb: float = _f(0.0, "KV pool: host-memory tier of this worker, GiB (0: off)")
    kv_pool_disk: str | None = _f(None, "KV pool: local-disk tier in this folder (shared by "
                                  "the workers of a host that name the same one)")  # fmt: skip
    kv_pool_disk_gb: float = _f(0.0, "KV pool: size cap of the disk tier, GiB (0: 10 GiB)")
    kv_pool_redis: str | None = _f(
        None, "KV pool: shared Redis tier, redis://HOST:PORT[/DB] (shared by every worker "
        "that names it)",
    )  # fmt: skip
    kv_pool_chunk_mb: float = _f(
        2.0, "KV pool: target size of a stored value, MiB: the whole number of blocks nearest "
        "it (1-16) makes one chunk (default model: 3 blocks)",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.kv_pool_memory_gb < 0 or self.kv_pool_disk_gb < 0:
            raise ValueError("kv_pool_memory_gb and kv_pool_disk_gb must be >= 0")
        if not self.kv_pool_chunk_mb > 0:
            raise ValueError("kv_pool_chunk_mb must be > 0")
        if self.kv_pool_disk_gb > 0 and self.kv_pool_disk is None:
            raise ValueError("kv_pool_disk_gb needs kv_pool_disk (a folder)")
        if self.kv_pool_redis is not None and not self.kv_pool_redis.startswith("redis://"):
            raise ValueError(
                f"kv_pool_redis must look like redis://HOST:PORT[/DB], got {self.kv_pool_redis!r}"
            )
        if self.deadline_s <= 0 or self.lease_s <= 0 or self.kv_wait_s <= 0:
            raise ValueError("deadline, lease and kv_wait must be > 0 seconds")
        if self.slo_tpot_s is not None and self.slo_tpot_s <= 0:
            raise ValueError("slo_tpot_s must be > 0 seconds")
        if self.shm_mb < 0:
            raise ValueError("shm_mb must be >= 0 (0: every frame goes inline)")


@dataclass(frozen=True)
class RouterConfig:
    """The router core's knobs (`pdserve serve` / `pdserve router` flags, `LocalCluster`)."""

    policy: str = _f("least_outstanding", "routing policy: least_outstanding | round_robin")
    deadline_s: float = _f(5.0, "seconds of silence before a hand-off fails", "--deadline")
    handoff_tokens: int = _f(1, "tokens generated on P before the hand-off")
    max_inflight: int = _f(256, "requests in flight before new ones get 429 with Retry-After")
    request_timeout_s: float = _f(
        600.0, "seconds a request may take in all before it ends with 504", "--request-timeout"
    )
    liveness_timeout_s: float = _f(
        2.0, "seconds without a heartbeat before a worker is taken out of routing",
        "--liveness-timeout",
    )  # fmt: skip
    stuck_timeout_s: float = _f(
        30.0, "seconds a worker may make no progress (its main loop does not turn and no model "
        "layer finishes; heartbeat still alive) before it counts as stuck", "--stuck-timeout",
    )  # fmt: skip
    max_recoveries: int = _f(
        2, "times one request may move to other workers after a worker goes down"
    )
    prefix_routing: bool = _f(
        True, "route to workers holding the prompt's cached prefix (and keep conversations, "
        "by the OpenAI `user` field, where their KV is)",
    )  # fmt: skip
    conversation_local_tokens: int = _f(
        512,
        "without a planner, a conversation's follow-up is prefilled on the decode worker "
        "holding its history when at most this many of its tokens are not cached there (else "
        "on P, its KV sent to that worker); 0: always on P",
    )
    max_retries: int = _f(1, "retries of a failed hand-off before D recomputes", cli=False)
    stats_interval_s: float = _f(1.0, "seconds between stats polls of each worker", cli=False)
    heartbeat_interval_s: float = _f(0.5, "seconds between heartbeat pings", cli=False)
    autobalance_interval_s: float = _f(1.0, "seconds between autobalance checks", cli=False)

    def __post_init__(self) -> None:
        for name in ("deadline_s", "request_timeout_s", "liveness_timeout_s", "stuck_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds")
        if self.conversation_local_tokens < 0:
            raise ValueError("conversation_local_tokens must be >= 0 (0: follow-ups on P)")
        if self.max_inflight < 1 or self.handoff_tokens < 1:
            raise ValueError("max_inflight and handoff_tokens must be >= 1")


# WorkerConfig's KV pool fields: `pdserve serve` takes them too and hands them to its workers.
KV_POOL_FIELDS = (
    "kv_pool_memory_gb",
    "kv_pool_disk",
    "kv_pool_disk_gb",
    "kv_pool_redis",
    "kv_pool_chunk_mb",
)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _cli_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def config_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """The `cls` config a parsed namespace (from `add_config_args`) describes."""
    values = {f.name: getattr(args, f.name) for f in _cli_fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **overrides})


def config_argv(config: Any) -> list[str]:
    """The flags that `add_config_args` reads back as `config` (None fields left out)."""
    argv: list[str] = []
    for f in _cli_fields(type(config)):
        value, flag = getattr(config, f.name), _flag(f)
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag.removeprefix("--"))
        else:
            argv += [flag, str(value)]
    return argv


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one `--flag` per field of a config dataclass, typed and documented from the field."""
    hints = get_type_hints(cls)
    for f in _cli_fields(cls):
        if f.name in skip:
            continue
        flag = _flag(f)
        kind = hints[f.name]
        helptext = f"{f.metadata.get('help', '')} (default: {f.default})"
        if kind is bool:
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=helptext,
            )
            continue
        base = _scalar_type(kind)
        parser.add_argument(flag, dest=f.name, type=base, default=f.default, help=helptext)


def _scalar_type(kind: Any) -> Any:
    args = getattr(kind, "__args__", None)
    if args:  # Optional[X]
        kind = next(a for a in args if a is not type(None))
    return kind


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments present in a parsed namespace."""
    names = {f.name for c in _SECTIONS.values() for f in dataclasses.fields(c)}
    return {k: v for k, v in vars(args).items() if k in names}


def _engine_field(name: str) -> tuple[dataclasses.Field, Any]:
    for cls in _SECTIONS.values():
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f, get_type_hints(cls)[name]
    raise ValueError(f"unknown engine argument {name!r}")


def add_engine_overrides(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    """Flags for the engine fields `names`, each unset (None) unless given: a process that
    starts workers passes on only what its user chose (`engine_overrides`)."""
    for name in names:
        f, kind = _engine_field(name)
        flag = "--" + name.replace("_", "-")
        helptext = f"{f.metadata.get('help', '')} (default: the engine's, {f.default})"
        if kind is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=helptext
            )
        else:
            parser.add_argument(
                flag, dest=name, type=_scalar_type(kind), default=None, help=helptext
            )


def engine_overrides(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    """The engine fields among `names` that the command line set."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
