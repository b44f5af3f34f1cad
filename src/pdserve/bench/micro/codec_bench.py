"""`pdserve bench codec`: what each KV codec costs in output quality, and what it saves on the
wire, measured on a real model; plus encode/decode and CRC-32 speeds.

Quality. A fixed list of English prompts (templates x topics, 30-200 tokens) runs as one batch,
greedy, `--max-tokens` tokens each, prefix caching off:
  * baseline: the KV never leaves the engine's paged cache;
  * per codec, "free" run: each prompt is prefilled (`engine.step()` until its first token is
    sampled); right after that step its prompt KV, tokens [0, prompt_len) of every layer, is
    gathered from the paged cache (block ids from `kv_manager.get_block_ids`), sent through
    `encode_frame` -> bytes -> `decode_frame`, exactly what D would receive, and scattered back;
    decoding then continues greedily.
  * per codec, "forced" run: the same, but every sampled token is replaced by the baseline's
    token (teacher forcing), so the next-token distributions of decode steps 1..K see the same
    context as the baseline and differ only through the KV. (Comparing distributions of the
    free run would, after the first differing token, compare different contexts.)
Every run adds the same prompts in the same order and takes the same steps, so batch shapes
match the baseline step by step; the "none" codec therefore reproduces the baseline bit for bit,
which checks the method itself.
  * token match = generated tokens equal to the baseline's at the same position / all generated
    tokens (free runs, all prompts). The first token comes from the prefill, before the transfer,
    as in a real P/D split, so it always matches.
  * KL = mean over prompts and decode steps 1..K (K = 16 or max_tokens - 1) of
    KL(p_baseline || p_codec) in nats over the full vocabulary. Logits are captured by swapping
    `engine.sampler` for a subclass that records the rows it samples from (and forces tokens).
  * bytes/token = whole frames (header + every layer's K and V) / prompt tokens; saved % vs none.

Speed. On random KV of the model's layout (`--speed-tokens` tokens x all layers, the engine's
dtype): encode and decode GB/s per codec, measured as uncompressed KV bytes / time (median of
`--repeats`), and whole frames (encode_frame + decode_frame, CRC-32 included); zlib.crc32 GB/s
on a `--crc-mb` MB buffer.
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve import argtypes
from pdserve.bench.harness import report, timing
from pdserve.bench.micro.codec_quality import (
    KL_STEPS,
    TEMPLATES,
    TOPICS,
    bench_prompts,
    measure_quality,
)
from pdserve.bench.micro.codec_report import Report, render_markdown, report_json
from pdserve.bench.micro.codec_speed import measure_speed

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine

DEFAULT_OUTPUT = Path("docs/benchmarks/kv_codec.md")
CODEC_NAMES = ("none", "int8", "int4")
BLOCK_SIZE = 16


# --------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    timing.add_model_arguments(parser)
    parser.add_argument(
        "--num-prompts",
        type=argtypes.positive_int,
        default=len(TOPICS) * len(TEMPLATES),
        help=f"prompts to run, <= {len(TOPICS) * len(TEMPLATES)} (default: all)",
    )
    parser.add_argument(
        "--max-tokens",
        type=argtypes.positive_int,
        default=64,
        help="greedy tokens per prompt (default: 64)",
    )
    parser.add_argument(
        "--codecs",
        type=argtypes.subset(CODEC_NAMES),
        default=list(CODEC_NAMES),
        help="comma-separated codecs to compare (default: none,int8,int4)",
    )
    parser.add_argument(
        "--speed-tokens",
        type=argtypes.positive_int,
        default=2048,
        help="tokens of the random KV for the speed table (default: 2048)",
    )
    parser.add_argument(
        "--crc-mb",
        type=argtypes.positive_int,
        default=64,
        help="zlib.crc32 buffer in MB (default: 64)",
    )
    parser.add_argument(
        "--repeats", type=argtypes.positive_int, default=5, help="timed runs per speed (default: 5)"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help=f"markdown report (default: {DEFAULT_OUTPUT})",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write results as JSON")


# --------------------------------------------------------------------------- report head


def command_line(args: argparse.Namespace) -> str:
    invoked = report.invoked_as("codec")
    if invoked is not None:
        return invoked
    parts = ["pdserve", "bench", "codec"]
    if args.model:
        parts += ["--model", str(args.model)]
    if args.threads:
        parts += ["--threads", str(args.threads)]
    for flag in ("num_prompts", "max_tokens", "speed_tokens", "crc_mb", "repeats"):
        parts += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return shlex.join([*parts, "--codecs", ",".join(args.codecs), "--output", str(args.output)])


# --------------------------------------------------------------------------- entry point


def build_engine(args: argparse.Namespace, prompt_lens: list[int]) -> LLMEngine:
    from pdserve import LLM

    blocks = sum(-(-(n + args.max_tokens) // BLOCK_SIZE) for n in prompt_lens) + 1
    llm = LLM(
        args.model,
        threads=args.threads,
        block_size=BLOCK_SIZE,
        num_blocks=blocks,
        enable_prefix_caching=False,
        max_num_seqs=len(prompt_lens),
    )
    return llm.engine


def run(args: argparse.Namespace) -> int:
    import torch

    from pdserve.engine import loader

    date = report.now()
    machine = report.machine_info(args.threads or torch.get_num_threads())
    texts = bench_prompts(args.num_prompts)
    tokenizer = loader.load_tokenizer(loader.resolve_model(args.model))
    prompts = [list(tokenizer.encode(t, add_special_tokens=True)) for t in texts]
    engine = build_engine(args, [len(p) for p in prompts])
    quality = measure_quality(engine, prompts, args.max_tokens, args.codecs)
    report.log("speed", "bench codec")
    speed = measure_speed(engine, args.speed_tokens, args.codecs, args.repeats)
    crc32_gbs = timing.measure_crc32(args.crc_mb, args.repeats)
    machine["load_average_end"] = report.load_average()
    rep = Report(
        date=date,
        command=command_line(args),
        machine=machine,
        model=_model_info(engine),
        settings={**_settings(args), "kl_steps": min(KL_STEPS, args.max_tokens - 1)},
        quality=quality,
        speed=speed,
        crc32_gbs=crc32_gbs,
        prompt_lens=[len(p) for p in prompts],
    )
    report.write(render_markdown(rep), report_json(rep), args)
    return 0


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    names = ("threads", "num_prompts", "max_tokens", "codecs", "speed_tokens", "crc_mb", "repeats")
    return {k: getattr(args, k) for k in names}


def _model_info(engine: LLMEngine) -> dict[str, Any]:
    arch = engine.arch
    return {
        "name": arch.name or engine.source.path.name,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "layers": arch.num_layers,
        "kv_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
    }


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.bench.micro.codec_bench", description=__doc__
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
