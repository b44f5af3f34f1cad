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

pdserve decode (per batch size B): B requests of `--decode-context` random tokens are added and
stepped until every one is decoding; after one warm-up step, `--decode-steps` steps are timed;
tokens/s = B * steps / time. The token budget fits all B prompts in one step, so every
request decodes from the same context.
  MBU = (weight bytes + KV bytes) / step time / read GB/s, with
        weight bytes = (every weight except the embedding table + the LM head matrix) * elem
                       (a tied head reads the embedding table once per step),
        KV bytes     = B * ctx * 2 * layers * kv_heads * head_dim * elem,
        ctx          = mean number of keys attended per timed step (prompt + generated so far).

Transformers (same weights: `from_pretrained(folder, gguf_file=...)` in float32, same threads):
  * prefill: one `model(prompt, use_cache=True, logits_to_keep=1)` forward, as `generate` does;
  * decode: a greedy loop of `model(next_token, cache=kv)` (`past_key_values=` before 5.x) +
    argmax over a batch of B equal-length prompts (no padding), timed over the same number of
    steps after the prefill and one warm-up step. This leaves out `generate()`'s per-step
    Python (logits processors, stopping criteria), so it slightly favours transformers.
Every number is the median over `--repeats` runs, each after a warm-up run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import math
import os
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve import argtypes
from pdserve.bench import common

if TYPE_CHECKING:
    import torch

    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.loader import ModelSource
    from pdserve.engine.models.arch import ModelArch
    from pdserve.engine.request import SamplingParams

WARMUP_STEPS = 1  # decode steps run (untimed) between "all requests decoding" and the timing
MATMUL_N = 2048
BANDWIDTH_MIB = 1024  # well above the last-level cache (this 2-core VM has a 300 MiB L3)
ROOFLINE_REPEATS = 5
BLOCK_SIZE = 16
SEED = 0
NOISY_SPREAD = 1.3  # rows whose repeats differ more than this are flagged as noisy

SETTINGS = ("prompt_lens", "batch_sizes", "decode_steps", "decode_context", "repeats")

TARGET_PREFILL_LEN = 512
TARGET_PREFILL_MFU = 0.50
TARGET_DECODE_MBU = 0.70
TARGET_BATCH_SCALING = (8, 4.0)  # decode B=8 >= 4x the tokens/s of B=1


# --------------------------------------------------------------------------- arguments


_LIST_FLAGS = (
    ("--prompt-lens", [128, 512, 2048], "prefill prompt lengths"),
    ("--batch-sizes", [1, 8, 32], "decode batch sizes"),
)
_INT_FLAGS = (
    ("--decode-steps", 32, "decode steps timed per batch size, after a warm-up"),
    ("--decode-context", 128, "prompt length of the decode requests"),
    ("--repeats", 3, "timed runs per measurement; medians are reported"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser)
    for flag, default, text in _LIST_FLAGS:
        shown = ",".join(map(str, default))
        parser.add_argument(flag, type=argtypes.int_list, default=default, help=f"{text} ({shown})")
    for flag, value, text in _INT_FLAGS:
        parser.add_argument(
            flag, type=argtypes.positive_int, default=value, help=f"{text} ({value})"
        )
    parser.add_argument("--device", default="cpu", help="torch device of the engine: cpu | cuda")
    parser.add_argument("--dtype", default="float32", help="engine dtype: float32 | bfloat16")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    parser.add_argument("--output", type=Path, default=None, help="write the markdown report here")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")


# --------------------------------------------------------------------------- results


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

    @classmethod
    def from_arch(cls, arch: ModelArch, elem_size: int) -> ModelCost:
        from pdserve.engine.loader import expected_shapes

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
        )

    def prefill_flops(self, n: int) -> float:
        attention = 4 * self.layers * self.heads * self.head_dim * n * n / 2
        return 2.0 * self.matmul_params * n + attention + 2.0 * self.vocab * self.hidden

    def weight_bytes(self) -> int:
        return self.read_params * self.elem_size

    def kv_bytes(self, batch: int, context: float) -> float:
        return batch * context * 2 * self.layers * self.kv_heads * self.head_dim * self.elem_size


@dataclass
class Row:
    phase: str  # "prefill" | "decode"
    size: int  # prompt length (prefill) or batch size (decode)
    seconds: float  # median time of the prefill step, or of one decode step
    tokens_per_s: float
    utilization: float  # MFU (prefill) or MBU (decode), as a fraction
    context: float  # prefill: n; decode: mean keys attended per timed step
    samples_s: list[float] = field(default_factory=list)
    hf_seconds: float | None = None
    hf_tokens_per_s: float | None = None
    hf_samples_s: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"prefill {self.size}" if self.phase == "prefill" else f"decode B={self.size}"

    @property
    def ratio(self) -> float | None:
        return None if not self.hf_tokens_per_s else self.tokens_per_s / self.hf_tokens_per_s

    @property
    def spread(self) -> float:
        """Largest max/min over the timed repeats of either side: > NOISY_SPREAD is suspect."""
        return max((max(s) / min(s) for s in (self.samples_s, self.hf_samples_s) if s), default=1.0)


@dataclass
class Report(common.ReportHead):
    model: dict[str, Any]
    settings: dict[str, Any]
    roofline: Roofline
    rows: list[Row]
    targets: list[common.Target] = field(default_factory=list)


# --------------------------------------------------------------------------- helpers


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- roofline


def measure_roofline(repeats: int = ROOFLINE_REPEATS) -> Roofline:
    import torch

    x = torch.ones(BANDWIDTH_MIB * 2**20 // 4)
    sum_gbs = x.nbytes / common.median_seconds(lambda: x.sum(), repeats) / 1e9
    n = math.isqrt(x.numel())
    matrix, vector = x[: n * n].view(n, n), torch.ones(n)
    matvec_gbs = (
        matrix.nbytes / common.median_seconds(lambda: torch.mv(matrix, vector), repeats) / 1e9
    )
    dst = torch.empty_like(x)
    copy_gbs = 2 * x.nbytes / common.median_seconds(lambda: dst.copy_(x), repeats) / 1e9
    return Roofline(
        matmul_gflops=_matmul_gflops(MATMUL_N, repeats),
        read_gbs=max(sum_gbs, matvec_gbs),
        sum_gbs=sum_gbs,
        matvec_gbs=matvec_gbs,
        copy_gbs=copy_gbs,
    )


def _matmul_gflops(n: int, repeats: int) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    seconds = common.median_seconds(lambda: torch.matmul(a, b, out=out), repeats)
    return 2 * n**3 / seconds / 1e9


# --------------------------------------------------------------------------- pdserve


def build_engine(args: argparse.Namespace, threads: int) -> LLMEngine:
    from pdserve import LLM

    decode_len = args.decode_context + WARMUP_STEPS + args.decode_steps + 2
    blocks = max(
        -(-(max(args.prompt_lens) + 1) // BLOCK_SIZE) + 1,
        max(args.batch_sizes) * (-(-decode_len // BLOCK_SIZE) + 1),
    )
    # Budget: the longest prompt in one chunk, and all decode prompts in one step, so every
    # decode request starts generating at the same step with the same context.
    budget = max(*args.prompt_lens, max(args.batch_sizes) * args.decode_context)
    llm = LLM(
        args.model,
        threads=threads,
        block_size=BLOCK_SIZE,
        num_blocks=blocks,
        enable_prefix_caching=False,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=budget,
        device=args.device,  # cuda: the roofline (MFU/MBU) is still the CPU's
        dtype=args.dtype,
    )
    engine = llm.engine
    if max(args.prompt_lens) >= engine.max_model_len or decode_len >= engine.max_model_len:
        raise ValueError(
            f"the model's context is {engine.max_model_len} tokens; lower --prompt-lens "
            f"(max {max(args.prompt_lens)}) or --decode-context + --decode-steps ({decode_len})"
        )
    return engine


def _greedy(max_tokens: int) -> SamplingParams:
    from pdserve import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def pdserve_prefill(engine: LLMEngine, n: int, repeats: int, gen: torch.Generator) -> list[float]:
    """Seconds of the single step that prefills an n-token prompt, per timed repeat."""
    _prefill_once(engine, common.random_ids(gen, n, engine.arch.vocab_size))  # warm-up
    return [
        _prefill_once(engine, common.random_ids(gen, n, engine.arch.vocab_size))
        for _ in range(repeats)
    ]


def _prefill_once(engine: LLMEngine, ids: list[int]) -> float:
    engine.add_request(ids, _greedy(1))
    seconds = common.timed(engine.step)
    if engine.has_unfinished_requests():
        raise RuntimeError(f"a {len(ids)}-token prompt did not prefill in one step")
    return seconds


def pdserve_decode(
    engine: LLMEngine, batch: int, context: int, steps: int, repeats: int, gen: torch.Generator
) -> tuple[list[float], float]:
    """Seconds per decode step for each timed repeat, and the mean keys attended per step."""
    _decode_once(engine, batch, context, steps, gen)  # warm-up
    runs = [_decode_once(engine, batch, context, steps, gen) for _ in range(repeats)]
    return [r[0] for r in runs], runs[0][1]


def _decode_once(
    engine: LLMEngine, batch: int, context: int, steps: int, gen: torch.Generator
) -> tuple[float, float]:
    params = _greedy(WARMUP_STEPS + steps + 2)  # never finishes inside the timed window
    rids = [
        engine.add_request(common.random_ids(gen, context, engine.arch.vocab_size), params)
        for _ in range(batch)
    ]
    try:
        _step_until_decoding(engine, rids)
        for _ in range(WARMUP_STEPS):
            _decode_step(engine, batch)
        requests = engine.scheduler.requests
        computed = statistics.mean(requests[r].num_computed_tokens for r in rids)
        seconds = common.timed(lambda: _decode_step(engine, batch), steps)
    finally:
        for rid in rids:
            engine.abort_request(rid)
    return seconds / steps, computed + (steps + 1) / 2


def _step_until_decoding(engine: LLMEngine, rids: list[str]) -> None:
    requests = engine.scheduler.requests
    while any(requests[r].num_tokens - requests[r].num_computed_tokens > 1 for r in rids):
        engine.step()


def _decode_step(engine: LLMEngine, batch: int) -> None:
    outputs = engine.step()
    if len(outputs) != batch:
        raise RuntimeError(f"a decode step produced {len(outputs)} tokens, expected {batch}")


def run_pdserve(
    args: argparse.Namespace, engine: LLMEngine, cost: ModelCost, roof: Roofline
) -> list[Row]:
    import torch

    gen = torch.Generator().manual_seed(SEED)
    rows = []
    for n in args.prompt_lens:
        _log(f"pdserve prefill {n}")
        samples = pdserve_prefill(engine, n, args.repeats, gen)
        rows.append(_prefill_row(n, samples, cost, roof))
    for b in args.batch_sizes:
        _log(f"pdserve decode B={b}")
        samples, ctx = pdserve_decode(
            engine, b, args.decode_context, args.decode_steps, args.repeats, gen
        )
        rows.append(_decode_row(b, samples, ctx, cost, roof))
    return rows


def _prefill_row(n: int, samples: list[float], cost: ModelCost, roof: Roofline) -> Row:
    s = statistics.median(samples)
    mfu = cost.prefill_flops(n) / s / (roof.matmul_gflops * 1e9)
    return Row("prefill", n, s, n / s, mfu, float(n), samples)


def _decode_row(b: int, samples: list[float], ctx: float, cost: ModelCost, roof: Roofline) -> Row:
    s = statistics.median(samples)
    read = cost.weight_bytes() + cost.kv_bytes(b, ctx)
    return Row("decode", b, s, b / s, read / s / (roof.read_gbs * 1e9), ctx, samples)


# --------------------------------------------------------------------------- transformers


def load_hf(source: ModelSource) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(source.folder),
        gguf_file=source.gguf_file,
        dtype=torch.float32,
        local_files_only=True,
    )
    return model.eval()


class HFRunner:
    """Forward calls under the argument names of the installed transformers (5.x: `cache`,
    `logits_to_keep`; 4.x: `past_key_values`, `num_logits_to_keep`)."""

    def __init__(self, model: Any) -> None:
        params = inspect.signature(model.forward).parameters
        self.model = model
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        keep = [k for k in ("logits_to_keep", "num_logits_to_keep") if k in params]
        self.keep_kwargs = {keep[0]: 1} if keep else {}

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Forward a [B, n] prompt; the LM head runs on the last position only, as in generate."""
        return self._next(self.model(input_ids=ids, use_cache=True, **self.keep_kwargs))

    def decode(self, token: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        return self._next(self.model(input_ids=token, use_cache=True, **{self.cache_arg: cache}))

    @staticmethod
    def _next(out: Any) -> tuple[torch.Tensor, Any]:
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        return out.logits[:, -1].argmax(-1, keepdim=True), cache


def hf_prefill_times(hf: HFRunner, n: int, repeats: int, gen: torch.Generator) -> list[float]:
    import torch

    ids = torch.tensor([common.random_ids(gen, n, hf.model.config.vocab_size)])
    with torch.inference_mode():
        return common.sample_times(lambda: hf.prefill(ids), repeats)


def hf_decode_times(
    hf: HFRunner, batch: int, context: int, steps: int, repeats: int, gen: torch.Generator
) -> list[float]:
    """Seconds per greedy decode step of a batch of equal-length prompts, per timed repeat."""
    _hf_decode_once(hf, batch, context, steps, gen)  # warm-up
    return [_hf_decode_once(hf, batch, context, steps, gen) for _ in range(repeats)]


def _hf_decode_once(
    hf: HFRunner, batch: int, context: int, steps: int, gen: torch.Generator
) -> float:
    import torch

    vocab = hf.model.config.vocab_size
    prompt = torch.tensor([common.random_ids(gen, context, vocab) for _ in range(batch)])
    with torch.inference_mode():
        state = list(hf.prefill(prompt))

        def step() -> None:
            state[0], state[1] = hf.decode(state[0], state[1])

        for _ in range(WARMUP_STEPS):
            step()
        return common.timed(step, steps) / steps


def run_hf(args: argparse.Namespace, source: ModelSource, rows: list[Row]) -> None:
    import torch

    _log("transformers: loading the same weights")
    hf = HFRunner(load_hf(source))
    gen = torch.Generator().manual_seed(SEED)
    for row in rows:
        _log(f"transformers {row.label}")
        if row.phase == "prefill":
            row.hf_samples_s = hf_prefill_times(hf, row.size, args.repeats, gen)
        else:
            row.hf_samples_s = hf_decode_times(
                hf, row.size, args.decode_context, args.decode_steps, args.repeats, gen
            )
        row.hf_seconds = statistics.median(row.hf_samples_s)
        row.hf_tokens_per_s = row.size / row.hf_seconds


# --------------------------------------------------------------------------- targets


def _find(rows: list[Row], phase: str, size: int) -> Row | None:
    return next((r for r in rows if r.phase == phase and r.size == size), None)


def evaluate_targets(rows: list[Row]) -> list[common.Target]:
    prefill, d1 = _find(rows, "prefill", TARGET_PREFILL_LEN), _find(rows, "decode", 1)
    b, factor = TARGET_BATCH_SCALING
    db = _find(rows, "decode", b)
    ratios = [r.ratio for r in rows if r.ratio is not None]
    return [
        common.Target(
            f"prefill MFU at {TARGET_PREFILL_LEN} tokens >= {TARGET_PREFILL_MFU:.0%}",
            f"{prefill.utilization:.1%}" if prefill else "not run",
            prefill.utilization >= TARGET_PREFILL_MFU if prefill else None,
        ),
        common.Target(
            f"decode B=1 MBU >= {TARGET_DECODE_MBU:.0%}",
            f"{d1.utilization:.1%}" if d1 else "not run",
            d1.utilization >= TARGET_DECODE_MBU if d1 else None,
        ),
        _scaling_target(d1, db, b, factor),
        common.Target(
            "never slower than transformers (every pdserve/HF >= 1)",
            f"min {min(ratios):.2f}x" if ratios else "not run",
            min(ratios) >= 1.0 if ratios else None,
        ),
    ]


def _scaling_target(d1: Row | None, db: Row | None, b: int, factor: float) -> common.Target:
    name = f"decode B={b} tokens/s >= {factor:g}x B=1"
    if d1 is None or db is None:
        return common.Target(name, "not run", None)
    gain = db.tokens_per_s / d1.tokens_per_s
    return common.Target(name, f"{gain:.2f}x", gain >= factor)


# --------------------------------------------------------------------------- report


def machine_info(threads: int) -> dict[str, Any]:
    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = "not installed"
    return common.machine_info(threads, transformers=hf_version)


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
        "weight_bytes_per_step": cost.weight_bytes(),
    }


def command_line(args: argparse.Namespace, threads: int) -> str:
    """The invoking command if it was `pdserve bench engine ...`, else an equivalent one."""
    invoked = common.invoked_as("engine")
    if invoked is not None:
        return invoked
    parts = ["pdserve", "bench", "engine", "--threads", str(threads)]
    if args.model:
        parts += ["--model", str(args.model)]
    for flag in ("prompt_lens", "batch_sizes"):
        parts += [f"--{flag.replace('_', '-')}", ",".join(map(str, getattr(args, flag)))]
    for flag in ("decode_steps", "decode_context", "repeats"):
        parts += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    parts += ["--no-hf"] if args.no_hf else []
    return shlex.join(parts)


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def render_markdown(rep: Report) -> str:
    lines = [
        "# pdserve engine benchmark",
        "",
        *_header(rep),
        "",
        *_results_table(rep.rows),
        *_noise_note(rep.rows),
        "",
        "## Targets",
        "",
        "| target | measured | status |",
        "|---|---|---|",
        *(f"| {t.name} | {t.measured} | {t.status} |" for t in rep.targets),
        "",
        "MFU = model FLOPs / time / matmul FLOP/s; MBU = (weight + KV bytes) / step time / "
        "read GB/s; HF decode is a greedy forward loop with its KV cache (not `generate`). "
        "Formulas: `pdserve.bench.micro.engine_bench`.",
        "",
    ]
    return "\n".join(lines)


def _header(rep: Report) -> list[str]:
    m, roof, model, st = rep.machine, rep.roofline, rep.model, rep.settings
    ends = (m["load_average"], m.get("load_average_end", m["load_average"]))
    load = "/".join(f"{x[0]:.2f}" for x in ends)
    return [
        f"- date: {rep.date}",
        f"- command: `{rep.command}`",
        f"- model: {model['name']} ({model['source']}, {model['dtype']}, {model['layers']} "
        f"layers, {model['matmul_params'] / 1e6:.1f} M matmul params, "
        f"{model['weight_bytes_per_step'] / 1e6:.0f} MB of weights read per decode step)",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads used, "
        f"torch {m['torch']}, transformers {m['transformers']}, "
        f"load average (1 min) at start/end {load}",
        f"- roofline (torch, {m['threads']} threads, {BANDWIDTH_MIB} MiB buffers): matmul "
        f"{roof.matmul_gflops:.1f} GFLOP/s ({MATMUL_N}x{MATMUL_N} fp32); read "
        f"{roof.read_gbs:.1f} GB/s (bytes read / time, best of torch.sum "
        f"{roof.sum_gbs:.1f} and matvec {roof.matvec_gbs:.1f}: the MBU reference); copy "
        f"{roof.copy_gbs:.1f} GB/s ((read + written) / time)",
        f"- decode: {st['decode_context']}-token random prompts, {WARMUP_STEPS} warm-up + "
        f"{st['decode_steps']} timed steps; every number is a median of {st['repeats']} runs",
    ]


def _noise_note(rows: list[Row]) -> list[str]:
    noisy = [f"{r.label} ({r.spread:.1f}x)" for r in rows if r.spread > NOISY_SPREAD]
    above = [r.label for r in rows if r.utilization > 1.0]
    notes = []
    if noisy:
        notes.append(f"Noisy (slowest/fastest repeat > {NOISY_SPREAD}x): {', '.join(noisy)}.")
    if above:
        notes.append(
            f"Above 100% of the roofline: {', '.join(above)}; the roofline was measured while "
            "the machine was busier than during that row. Rerun on a quiet machine."
        )
    return ["", *notes] if notes else []


def _results_table(rows: list[Row]) -> list[str]:
    out = [
        "| run | pdserve tok/s | pdserve ms | HF tok/s | pdserve/HF | MFU / MBU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kind = "MFU" if r.phase == "prefill" else "MBU"
        out.append(
            f"| {r.label} | {r.tokens_per_s:.1f} | {r.seconds * 1e3:.1f} | "
            f"{_fmt(r.hf_tokens_per_s, '.1f')} | {_fmt(r.ratio, '.2f')} | "
            f"{kind} {r.utilization:.1%} |"
        )
    return out


def report_json(rep: Report) -> dict[str, Any]:
    data = asdict(rep)
    for row, raw in zip(rep.rows, data["rows"], strict=True):
        raw.update(label=row.label, ratio=row.ratio, spread=row.spread)
    for target, raw in zip(rep.targets, data["targets"], strict=True):
        raw["status"] = target.status
    return data


# --------------------------------------------------------------------------- entry point


def run(args: argparse.Namespace) -> int:
    import torch

    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    machine = machine_info(threads)
    _warn_if_busy(machine)
    _log(f"roofline with {threads} threads")
    roof = measure_roofline()
    _log("loading pdserve engine")
    engine = build_engine(args, threads)
    cost = ModelCost.from_arch(engine.arch, engine.dtype.itemsize)
    rows = run_pdserve(args, engine, cost, roof)
    source, model = engine.source, model_info(engine, cost)
    del engine
    gc.collect()
    if not args.no_hf:
        run_hf(args, source, rows)
    machine["load_average_end"] = list(os.getloadavg())
    rep = Report(
        date=date,
        command=command_line(args, threads),
        machine=machine,
        model=model,
        settings={k: getattr(args, k) for k in SETTINGS},
        roofline=roof,
        rows=rows,
        targets=evaluate_targets(rows),
    )
    common.write(render_markdown(rep), report_json(rep), args)
    return 0


def _warn_if_busy(machine: dict[str, Any]) -> None:
    load = machine["load_average"][0]
    if load > 0.5 and machine["threads"] >= (machine["cores"] or 1):
        _log(
            f"load average {load:.2f} with every core in use: timings will be noisy "
            "(with torch's OpenMP threads, a busy core can slow each op by milliseconds); "
            "use --threads 1 or a quiet machine"
        )
