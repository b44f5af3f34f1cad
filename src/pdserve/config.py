"""Configuration: frozen dataclasses, one per concern, each field with a default and a help string.

The CLI is generated from these (`add_config_args`), and `EngineConfig.from_kwargs` maps the flat
keyword arguments of `LLM(**engine_args)` onto them, so a name means the same thing everywhere.
Validation raises `ValueError` saying what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, get_type_hints

# Weight quantizations (engine/quant.py implements them; named here so config needs no torch).
QUANTIZATIONS = ("none", "int8")


def check_quantization(name: str) -> None:
    """The name alone; what the model, dtype and device can take is checked at engine start."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {name!r}")


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = _f(
        None, "HF folder (config.json + *.safetensors) or .gguf file; default: SmolLM2-135M"
    )
    dtype: str = _f("float32", "weights and activations: float32 | bfloat16 | float16")
    quantization: str = _f(
        "none",
        "projection weights: none (as --dtype) | int8 (int8 per output channel, int8 "
        "activations per token; CPU, float32 only)",
    )
    device: str = _f("cpu", "torch device: cpu | cuda | cuda:N")
    max_model_len: int | None = _f(None, "context cap in tokens; default: the model's own")
    seed: int = _f(0, "seed for requests that do not set their own")

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        check_quantization(self.quantization)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _f(16, "tokens per KV block")
    num_blocks: int | None = _f(None, "KV blocks; default: derived from kv_cache_memory_gb")
    kv_cache_memory_gb: float = _f(1.0, "memory for the KV cache when num_blocks is not set")
    enable_prefix_caching: bool = _f(True, "reuse KV of shared prompt prefixes")

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = _f(2048, "token budget of one engine step")
    max_num_seqs: int = _f(64, "cap on running requests")
    enable_chunked_prefill: bool = _f(True, "split long prompts across steps")
    decode_first: bool = _f(True, "schedule running decodes before new prompts each step")

    def __post_init__(self) -> None:
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


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one `--flag` per field of a config dataclass, typed and documented from the field."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
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
