"""`pdserve bench engine`: prefill and decode throughput of the engine, against a roofline of
the same machine measured in the same run (MFU, MBU), and side by side with Hugging Face
transformers on the same weights and thread count.

Roofline (torch, fp32, the benchmark's thread count, median of 5 runs after a warm-up):
  * matmul GFLOP/s: 2 * n^3 / time for an n x n @ n x n matmul (n = 2048);
  * read GB/s: bytes read / time over a 1 GiB fp32 buffer (well above the last-level cache),
    the better of `torch.sum(x)` and `torch.mv(x.view(n, n), v)`. This is the MBU reference:
    a decode step reads its weights and KV cache (mostly as matrix @ vector) and writes little;
  * copy GB/s: (bytes read + bytes written) / time of a 1 GiB copy, for context only.

pdserve prefill (per prompt length n): one `engine.step()` that runs the whole prompt as one
chunk (the token budget is >= the longest prompt, prefix caching is off so repeats never hit the
cache), sampling included; tokens/s = n / time.
  MFU = model FLOPs / time / matmul FLOP/s, with model FLOPs =
        2 * (non-embedding matmul params) * n            q, k, v, o, gate, up, down
      + 4 * layers * heads * head_dim * n^2 / 2           QK^T and PV, causal half
      + 2 * vocab * hidden                                LM head for the one sampled position.

pdserve decode (per batch size B and context C): B requests are admitted already prefilled,
through the P/D hand-off API (`reserve_kv`, `write_kv` of random K/V for C tokens,
`admit_prefilled`), so every request decodes from C tokens of context in its own KV blocks
without B prefills of C tokens (minutes at B=32, C=2048; they do not change a decode step's
work). After one warm-up step, `--decode-steps` steps are timed; tokens/s = B * steps / time.
Rounds (`run_rounds`): a warm-up round, then `--repeats` rounds; a round goes through the
points (prefill lengths, then decode points), and each point runs once on every side that has
it (each pdserve variant, transformers, llama.cpp), back to back, the sides in reverse order
every other round. So sample i of every side and point comes from round i: the ratios between
sides compare samples taken seconds apart, and those between points (batch 8 / batch 1,
C=2048 / C=128) samples of the same round, not a side's repeats against another's a quarter
of an hour later. A ratio against a peer is the median of the rounds' ratios (`paired_ratio`): on a
shared VM whose speed drifts by 1.3x between runs, the old order (all of pdserve, then all of
transformers) put pdserve's prefill at 2048 tokens at 0.90x, 0.99x and 1.01x of transformers'
in three runs.
  MBU = (weight bytes + KV bytes) / step time / read GB/s, with
        weight bytes = the projection and LM head matrices as stored (int8 + scales when
                       quantized; `quantize.projection_bytes`) (a step reads only its tokens' rows
                       of the embedding table, which is not counted),
        KV bytes     = B * ctx * 2 * layers * kv_heads * head_dim * elem,
        ctx          = mean number of keys attended per timed step (C + generated so far).
  Attention share: after the timed steps, the same number of steps runs again with
  `llama.paged_attention` wrapped by a timer (CPU ops are synchronous, so wall time inside it
  is its cost: the KV write, any gather, SDPA); share = time inside / step time of that run.
  The wrapper's own cost (two clock reads per layer) is in the step time.
  `--quantization none,int8` repeats every pdserve row per quantization, side by side.

Transformers (same weights: `from_pretrained(folder, gguf_file=...)` in float32, same threads):
  * prefill: one `model(prompt, use_cache=True, logits_to_keep=1)` forward, as `generate` does;
  * decode: a `DynamicCache` filled with random K/V of C tokens per request, then a greedy loop
    of `model(next_token, cache=kv)` (`past_key_values=` before 5.x) + argmax over the batch,
    timed over the same number of steps after one warm-up step. This leaves out `generate()`'s
    per-step Python (logits processors, stopping criteria), so it slightly favours transformers.
    Points with B * C > `--hf-max-kv-tokens` are skipped (its cache grows by concatenation).

llama.cpp (llama-cpp-python on the same GGUF, its own Q4_1 kernels, the same threads, when
installed; `make bench-peers`): prefill = one `eval` of an n-token prompt from an empty cache;
decode (batch 1 only: the Python API runs one sequence) = `eval` of C random tokens, one
warm-up token, then `--decode-steps` single-token `eval`s timed (its sampling is left out).
Every number is the median over the `--repeats` rounds, after the warm-up round.

Code: this module is the command (flags, run); `engine_results` the rows, roofline and
model cost; `engine_measure` the roofline and pdserve; `engine_peers` transformers and
llama.cpp; `engine_report` the targets and the page.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve import argtypes
from pdserve.bench.harness import report, timing
from pdserve.bench.micro.engine_measure import (
    PdserveSystem,
    build_engine,
    measure_roofline,
    pdserve_rows,
)
from pdserve.bench.micro.engine_peers import (
    HFSystem,
    attach_peer,
    llama_cpp_system,
)
from pdserve.bench.micro.engine_report import evaluate_targets, render_markdown, report_json
from pdserve.bench.micro.engine_results import SEED, Key, ModelCost, Report, Row, System
from pdserve.config import DECODE_MATMULS, KV_CACHE_DTYPES, PREFILL_FORMATS, QUANTIZATIONS
from pdserve.engine.quantize import projection_bytes

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine

SETTINGS = (
    "prompt_lens",
    "batch_sizes",
    "contexts",
    "decode_steps",
    "repeats",
    "quantization",
    "kv_cache_dtypes",
    "decode_matmuls",
    "prefill_formats",
)


# --------------------------------------------------------------------------- arguments


_LIST_FLAGS = (
    ("--prompt-lens", [128, 512, 2048], "prefill prompt lengths"),
    ("--batch-sizes", [1, 8, 32], "decode batch sizes"),
    ("--contexts", [128, 1024, 2048], "decode contexts (tokens already in the KV cache)"),
)
_INT_FLAGS = (
    ("--decode-steps", 16, "decode steps timed per point, after a warm-up"),
    ("--repeats", 3, "timed runs per measurement; medians are reported"),
    ("--hf-max-kv-tokens", 16384, "skip transformers decode points with B * C above this"),
)


def variant_label(
    quantization: str, kv_cache_dtype: str, decode_matmul: str = "auto", prefill: str = "auto"
) -> str:
    """A row's pdserve variant: the quantization, plus the KV dtype when not the model's, the
    decode matmul when not the engine's choice and the prefill format when not `auto`'s."""
    label = quantization if kv_cache_dtype == "auto" else f"{quantization} kv={kv_cache_dtype}"
    label = label if decode_matmul == "auto" else f"{label} mm={decode_matmul}"
    return label if prefill == "auto" else f"{label} prefill={prefill}"


def variants(args: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """(quantization, KV dtype, decode matmul, prefill format) per engine measured; decode
    matmuls vary for float32 weights only (a quantized model has its own kernels)."""
    return [
        (q, kv, mm, pf)
        for q in args.quantization
        for kv in args.kv_cache_dtypes
        for mm in (args.decode_matmuls if q == "none" else ["auto"])
        for pf in args.prefill_formats
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    timing.add_model_arguments(parser)
    for flag, default, text in _LIST_FLAGS:
        shown = ",".join(map(str, default))
        parser.add_argument(flag, type=argtypes.int_list, default=default, help=f"{text} ({shown})")
    for flag, value, text in _INT_FLAGS:
        parser.add_argument(
            flag, type=argtypes.positive_int, default=value, help=f"{text} ({value})"
        )
    parser.add_argument(
        "--quantization",
        type=argtypes.subset(QUANTIZATIONS),
        default=["none", "int8"],
        help="pdserve weight quantizations, each measured side by side (none,int8)",
    )
    parser.add_argument(
        "--kv-cache-dtypes",
        type=argtypes.subset(KV_CACHE_DTYPES),
        default=["auto"],
        help="KV cache dtypes, each measured with every quantization (auto: the model's dtype; "
        "float16 under w8g32)",
    )
    parser.add_argument(
        "--decode-matmuls",
        type=argtypes.subset(DECODE_MATMULS),
        default=["auto"],
        help="float32 decode matmuls (auto | tiles | torch), each measured with --quantization "
        "none (auto: the engine's choice)",
    )
    parser.add_argument(
        "--prefill-formats",
        type=argtypes.subset(PREFILL_FORMATS),
        default=["auto"],
        help="prompt rows' weight formats (auto | bf16x3 | bf16 | none), each measured with "
        "every quantization (auto: the engine's choice)",
    )
    parser.add_argument("--device", default="cpu", help="torch device of the engine: cpu | cuda")
    parser.add_argument("--dtype", default="float32", help="engine dtype: float32 | bfloat16")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp column")
    parser.add_argument("--no-attention", action="store_true", help="skip the attention-share run")
    parser.add_argument("--output", type=Path, default=None, help="write the markdown report here")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")


# --------------------------------------------------------------------------- report head


def machine_info(threads: int) -> dict[str, Any]:
    hf_version = report.version_of("transformers") or "not installed"
    return report.machine_info(
        threads, transformers=hf_version, llama_cpp=report.version_of("llama_cpp")
    )


def model_info(engine: LLMEngine, cost: ModelCost) -> dict[str, Any]:
    arch = engine.arch
    return {
        "name": arch.name or engine.source.path.name,
        "source": engine.source.kind,
        "path": str(engine.source.path),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "layers": arch.num_layers,
        "hidden": arch.hidden_size,
        "heads": arch.num_heads,
        "kv_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "vocab": arch.vocab_size,
        "tied_embeddings": arch.tie_word_embeddings,
        "matmul_params": cost.matmul_params,
        "weight_bytes_per_step": {},  # per quantization, filled by `run`
    }


def command_line(args: argparse.Namespace, threads: int) -> str:
    """The invoking command if it was `pdserve bench engine ...`, else an equivalent one."""
    invoked = report.invoked_as("engine")
    if invoked is not None:
        return invoked
    parts = ["pdserve", "bench", "engine", "--threads", str(threads)]
    if args.model:
        parts += ["--model", str(args.model)]
    for flag in ("prompt_lens", "batch_sizes", "contexts", "quantization"):
        parts += [f"--{flag.replace('_', '-')}", ",".join(map(str, getattr(args, flag)))]
    for flag in ("decode_steps", "repeats"):
        parts += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for flag in ("no_hf", "no_llama_cpp", "no_attention"):
        parts += [f"--{flag.replace('_', '-')}"] if getattr(args, flag) else []
    return shlex.join(parts)


# --------------------------------------------------------------------------- entry point


def run(args: argparse.Namespace) -> int:
    import torch

    date = report.now()
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    machine = machine_info(threads)
    _warn_if_busy(machine)
    report.log(f"roofline with {threads} threads")
    roof = measure_roofline()
    gen = torch.Generator().manual_seed(SEED)
    engines: list[tuple[PdserveSystem, ModelCost]] = []
    for q, kv, mm, pf in variants(args):
        label = variant_label(q, kv, mm, pf)
        report.log(f"loading pdserve engine ({label})")
        engine = build_engine(args, threads, q, kv, mm, pf)
        cost = ModelCost.from_arch(engine.arch, engine.dtype.itemsize, engine.cache.dtype.itemsize)
        engines.append((PdserveSystem(label, engine, args, gen), cost))
    first = engines[0][0]
    source, keys = first.engine.source, first.keys
    systems: list[System] = [s for s, _ in engines]
    hf = None if args.no_hf else HFSystem(args, source, keys)
    cpp, note = (None, None) if args.no_llama_cpp else llama_cpp_system(args, source, threads, keys)
    systems += [s for s in (hf, cpp) if s is not None]
    samples = run_rounds(systems, args.repeats)
    rows: list[Row] = []
    model = model_info(first.engine, engines[0][1])
    for system, cost in engines:
        rows += pdserve_rows(args, system, samples[system.name], cost, roof)
        q = system.engine.quantization
        model["weight_bytes_per_step"][q] = projection_bytes(system.engine.model)
    for side, peer in (("hf", hf), ("cpp", cpp)):
        if peer is not None:
            attach_peer(rows, side, samples[peer.name])
    machine["load_average_end"] = report.load_average()
    rep = Report(
        date=date,
        command=command_line(args, threads),
        machine=machine,
        model=model,
        settings={k: getattr(args, k) for k in SETTINGS},
        roofline=roof,
        rows=rows,
        targets=evaluate_targets(rows),
        notes=[] if note is None else [note],
    )
    report.write(render_markdown(rep), report_json(rep), args)
    return 0


def run_rounds(systems: list[System], repeats: int) -> dict[str, dict[Key, list[float]]]:
    """A warm-up round (discarded), then `repeats` rounds; a round goes through the points in
    order, and each point runs once on every side that has it, back to back: the sides in
    turn, in reverse order every other round (so no side always runs first). Sample i of every
    side and point comes from round i, seconds apart from the other sides' sample i. Returns
    each system's samples per point."""
    samples: dict[str, dict[Key, list[float]]] = {s.name: {k: [] for k in s.keys} for s in systems}
    keys = list(dict.fromkeys(k for s in systems for k in s.keys))
    for r in range(repeats + 1):
        report.log("warm-up round" if r == 0 else f"round {r}/{repeats}")
        for key in keys:
            for system in systems if r % 2 == 0 else systems[::-1]:
                if key in samples[system.name]:
                    seconds = system.once(key)
                    if r > 0:
                        samples[system.name][key].append(seconds)
    return samples


def _warn_if_busy(machine: dict[str, Any]) -> None:
    load = machine["load_average"][0]
    if load > 0.5 and machine["threads"] >= (machine["cores"] or 1):
        report.log(
            f"load average {load:.2f} with every core in use: timings will be noisy "
            "(with torch's OpenMP threads, a busy core can slow each op by milliseconds); "
            "use --threads 1 or a quiet machine"
        )
