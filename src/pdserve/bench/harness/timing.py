"""Measuring in this process: wall time of a call (median of repeats after a warm-up), the
CRC-32 speed every KV frame pays, random prompts, and the flags of an engine benchmark."""

from __future__ import annotations

import argparse
import os
import statistics
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve import argtypes

if TYPE_CHECKING:
    import torch


def timed(fn: Callable[[], object], times: int = 1) -> float:
    """Wall seconds of `times` calls of `fn`, together."""
    t0 = time.perf_counter()
    for _ in range(times):
        fn()
    return time.perf_counter() - t0


def sample_times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of each of `repeats` calls of `fn`, after one warm-up call."""
    fn()
    return [timed(fn) for _ in range(repeats)]


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median of `sample_times`."""
    return statistics.median(sample_times(fn, repeats))


def measure_crc32(megabytes: int, repeats: int) -> float:
    """zlib.crc32 speed in GB/s over a random buffer (what every KV frame's checksum costs)."""
    data = os.urandom(megabytes * 10**6)
    return len(data) / median_seconds(lambda: zlib.crc32(data), repeats) / 1e9


def random_ids(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    """`n` token ids drawn uniformly from the vocabulary (prompts that never share a prefix)."""
    import torch

    ids: list[int] = torch.randint(0, vocab, (n,), generator=gen).tolist()
    return ids


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--model` and `--threads`, as every engine benchmark spells them."""
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default: SmolLM2-135M")
    parser.add_argument(
        "--threads",
        type=argtypes.positive_int,
        default=None,
        help="torch threads; default: torch's choice",
    )
