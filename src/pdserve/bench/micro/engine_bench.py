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
  MBU = (weight bytes + KV bytes) / step time / read GB/s, with
        weight bytes = the projection and LM head matrices as stored (int8 + scales when
                       quantized; `quant.projection_bytes`) (a step reads only its tokens' rows
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
Every number is the median over `--repeats` runs, each after a warm-up run.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import inspect
import itertools
import math
import os
import shlex
import statistics
import sys
import time
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
_RIDS = itertools.count()
NOISY_SPREAD = 1.3  # rows whose repeats differ more than this are flagged as noisy

SETTINGS = ("prompt_lens", "batch_sizes", "contexts", "decode_steps", "repeats", "quantization")

TARGET_PREFILL_LEN = 512
TARGET_PREFILL_MFU = 0.50
TARGET_DECODE_MBU = 0.70
TARGET_BATCH_SCALING = (8, 5.0)  # decode B=8 >= 5x the tokens/s of B=1 (issue 12)
TARGET_CONTEXT = 1024  # decode targets at this context
TARGET_CONTEXT_GROWTH = (2048, 128, 1.3)  # step at 2048 <= 1.3x the step at 128 (B=1)
TARGET_PREFILL_VS_CPP = 1.5


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


def _quantizations(text: str) -> list[str]:
    from pdserve.config import QUANTIZATIONS

    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in QUANTIZATIONS]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"quantizations must be among {', '.join(QUANTIZATIONS)}, got {text!r}"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser)
    for flag, default, text in _LIST_FLAGS:
        shown = ",".join(map(str, default))
        parser.add_argument(flag, type=argtypes.int_list, default=default, help=f"{text} ({shown})")
    for flag, value, text in _INT_FLAGS:
        parser.add_argument(
            flag, type=argtypes.positive_int, default=value, help=f"{text} ({value})"
        )
    parser.add_argument(
        "--quantization",
        type=_quantizations,
        default=["none", "int8"],
        help="pdserve weight quantizations, each measured side by side (none,int8)",
    )
    parser.add_argument("--device", default="cpu", help="torch device of the engine: cpu | cuda")
    parser.add_argument("--dtype", default="float32", help="engine dtype: float32 | bfloat16")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp column")
    parser.add_argument("--no-attention", action="store_true", help="skip the attention-share run")
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
    quantization: str = "none"
    nominal_context: int = 0  # decode: C, the context the requests start from
    attention_share: float | None = None  # decode: time inside paged_attention / step time
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
        return None if not self.hf_tokens_per_s else self.tokens_per_s / self.hf_tokens_per_s

    @property
    def cpp_ratio(self) -> float | None:
        return None if not self.cpp_tokens_per_s else self.tokens_per_s / self.cpp_tokens_per_s

    @property
    def spread(self) -> float:
        """Largest max/min over the timed repeats of any side: > NOISY_SPREAD is suspect."""
        sides = (self.samples_s, self.hf_samples_s, self.cpp_samples_s)
        return max((max(s) / min(s) for s in sides if s), default=1.0)


@dataclass
class Report(common.ReportHead):
    model: dict[str, Any]
    settings: dict[str, Any]
    roofline: Roofline
    rows: list[Row]
    targets: list[common.Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


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


def build_engine(args: argparse.Namespace, threads: int, quantization: str) -> LLMEngine:
    from pdserve import LLM

    decode_len = max(args.contexts) + WARMUP_STEPS + 2 * args.decode_steps + 4
    blocks = max(
        -(-(max(args.prompt_lens) + 1) // BLOCK_SIZE) + 1,
        max(args.batch_sizes) * (-(-decode_len // BLOCK_SIZE) + 1),
    )
    llm = LLM(
        args.model,
        threads=threads,
        block_size=BLOCK_SIZE,
        num_blocks=blocks,
        enable_prefix_caching=False,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=max(*args.prompt_lens, max(args.batch_sizes)),
        quantization=quantization,
        device=args.device,  # cuda: the roofline (MFU/MBU) is still the CPU's
        dtype=args.dtype,
    )
    engine = llm.engine
    if max(args.prompt_lens) >= engine.max_model_len or decode_len >= engine.max_model_len:
        raise ValueError(
            f"the model's context is {engine.max_model_len} tokens; lower --prompt-lens "
            f"(max {max(args.prompt_lens)}) or --contexts + --decode-steps ({decode_len})"
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


@dataclass
class DecodePoint:
    batch: int
    context: int  # C: tokens of KV each request starts from
    steps: int


def pdserve_decode(
    engine: LLMEngine, point: DecodePoint, repeats: int, gen: torch.Generator
) -> tuple[list[float], float]:
    """Seconds per decode step for each timed repeat, and the mean keys attended per step."""
    _decode_once(engine, point, gen)  # warm-up
    runs = [_decode_once(engine, point, gen) for _ in range(repeats)]
    return [r[0] for r in runs], runs[0][1]


def admit_decoding(engine: LLMEngine, point: DecodePoint, gen: torch.Generator) -> list[str]:
    """B requests whose first C tokens of KV are in the cache (random values), each with its
    first output token: the next step decodes all of them from context C."""
    import torch

    arch = engine.arch
    c = point.context
    shape = (c, arch.num_kv_heads, arch.head_dim)
    k = torch.randn(shape, generator=gen).to(engine.dtype)
    v = torch.randn(shape, generator=gen).to(engine.dtype)
    params = _greedy(WARMUP_STEPS + 2 * point.steps + 2)  # never finishes inside the window
    rids = []
    for _ in range(point.batch):
        rid = f"bench-decode-{next(_RIDS)}"
        ids = common.random_ids(gen, c, arch.vocab_size)
        blocks = engine.reserve_kv(ids, params, rid, c)
        if blocks is None:
            raise RuntimeError("the KV cache is too small for this decode point")
        rids.append(rid)
        slots = engine.kv_slots(list(blocks), 0, c)
        for layer in range(arch.num_layers):
            engine.write_kv(slots, layer, k, v)
        engine.admit_prefilled(rid, common.random_ids(gen, 1, arch.vocab_size), c)
    return rids


def _decode_once(
    engine: LLMEngine, point: DecodePoint, gen: torch.Generator
) -> tuple[float, float]:
    rids = admit_decoding(engine, point, gen)
    try:
        for _ in range(WARMUP_STEPS):
            _decode_step(engine, point.batch)
        requests = engine.scheduler.requests
        computed = statistics.mean(requests[r].num_computed_tokens for r in rids)
        seconds = common.timed(lambda: _decode_step(engine, point.batch), point.steps)
    finally:
        for rid in rids:
            engine.abort_request(rid)
    return seconds / point.steps, computed + (point.steps + 1) / 2


def attention_share(engine: LLMEngine, point: DecodePoint, gen: torch.Generator) -> float | None:
    """Share of a decode step's wall time spent inside `llama.paged_attention`, measured in a
    separate run of the same steps with that function wrapped by a timer."""
    from pdserve.engine.models import llama

    inner = getattr(llama, "paged_attention", None)
    if inner is None:
        return None
    spent = [0.0]

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t0

    rids = admit_decoding(engine, point, gen)
    llama.paged_attention = timed  # type: ignore[attr-defined]
    try:
        for _ in range(WARMUP_STEPS):
            _decode_step(engine, point.batch)
        spent[0] = 0.0
        total = common.timed(lambda: _decode_step(engine, point.batch), point.steps)
    finally:
        llama.paged_attention = inner  # type: ignore[attr-defined]
        for rid in rids:
            engine.abort_request(rid)
    return spent[0] / total


def _decode_step(engine: LLMEngine, batch: int) -> None:
    outputs = engine.step()
    if len(outputs) != batch:
        raise RuntimeError(f"a decode step produced {len(outputs)} tokens, expected {batch}")


def decode_points(args: argparse.Namespace) -> list[DecodePoint]:
    return [DecodePoint(b, c, args.decode_steps) for c in args.contexts for b in args.batch_sizes]


def run_pdserve(
    args: argparse.Namespace, engine: LLMEngine, cost: ModelCost, roof: Roofline
) -> list[Row]:
    import torch

    from pdserve.engine.quant import projection_bytes

    gen = torch.Generator().manual_seed(SEED)
    q = engine.quantization
    weight_bytes = projection_bytes(engine.model)
    rows = []
    for n in args.prompt_lens:
        _log(f"pdserve ({q}) prefill {n}")
        samples = pdserve_prefill(engine, n, args.repeats, gen)
        rows.append(_prefill_row(n, samples, cost, roof, q))
    for point in decode_points(args):
        _log(f"pdserve ({q}) decode B={point.batch} C={point.context}")
        samples, ctx = pdserve_decode(engine, point, args.repeats, gen)
        row = _decode_row(point, samples, ctx, cost, roof, q, weight_bytes)
        if not args.no_attention:
            row.attention_share = attention_share(engine, point, gen)
        rows.append(row)
    return rows


def _prefill_row(
    n: int, samples: list[float], cost: ModelCost, roof: Roofline, quantization: str
) -> Row:
    s = statistics.median(samples)
    mfu = cost.prefill_flops(n) / s / (roof.matmul_gflops * 1e9)
    return Row("prefill", n, s, n / s, mfu, float(n), samples, quantization)


def _decode_row(
    point: DecodePoint,
    samples: list[float],
    ctx: float,
    cost: ModelCost,
    roof: Roofline,
    quantization: str,
    weight_bytes: int,
) -> Row:
    s, b = statistics.median(samples), point.batch
    read = weight_bytes + cost.kv_bytes(b, ctx)
    mbu = read / s / (roof.read_gbs * 1e9)
    return Row("decode", b, s, b / s, mbu, ctx, samples, quantization, point.context)


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
    hf: HFRunner, point: DecodePoint, repeats: int, gen: torch.Generator
) -> list[float]:
    """Seconds per greedy decode step of B requests from C tokens of (random) KV, per repeat."""
    _hf_decode_once(hf, point, gen)  # warm-up
    return [_hf_decode_once(hf, point, gen) for _ in range(repeats)]


def _hf_decode_once(hf: HFRunner, point: DecodePoint, gen: torch.Generator) -> float:
    import torch
    from transformers import DynamicCache

    cfg = hf.model.config
    kvh = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (point.batch, kvh, point.context, head_dim)
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        cache.update(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), layer)
    token = torch.tensor([common.random_ids(gen, point.batch, cfg.vocab_size)]).t()  # [B, 1]
    with torch.inference_mode():
        state: list[Any] = [token, cache]

        def step() -> None:
            state[0], state[1] = hf.decode(state[0], state[1])

        for _ in range(WARMUP_STEPS):
            step()
        return common.timed(step, point.steps) / point.steps


def _same_point(rows: list[Row], row: Row) -> list[Row]:
    """Rows of every quantization at `row`'s point (peers are measured once per point)."""
    return [r for r in rows if r.label == row.label]


def run_hf(args: argparse.Namespace, source: ModelSource, rows: list[Row]) -> None:
    import torch

    _log("transformers: loading the same weights")
    hf = HFRunner(load_hf(source))
    gen = torch.Generator().manual_seed(SEED)
    for row in [r for r in rows if r.quantization == rows[0].quantization]:
        if row.phase == "decode" and row.size * row.nominal_context > args.hf_max_kv_tokens:
            continue
        _log(f"transformers {row.label}")
        if row.phase == "prefill":
            samples = hf_prefill_times(hf, row.size, args.repeats, gen)
        else:
            point = DecodePoint(row.size, row.nominal_context, args.decode_steps)
            samples = hf_decode_times(hf, point, args.repeats, gen)
        for same in _same_point(rows, row):
            same.hf_samples_s = samples
            same.hf_seconds = statistics.median(samples)
            same.hf_tokens_per_s = row.size / same.hf_seconds


# --------------------------------------------------------------------------- llama.cpp


def llama_cpp_version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return str(llama_cpp.__version__)


def run_llama_cpp(
    args: argparse.Namespace, source: ModelSource, threads: int, rows: list[Row]
) -> str:
    """Fill the llama.cpp columns (prefill, decode B=1); returns a note on what ran."""
    if source.kind != "gguf":
        return "llama.cpp: not run (the model is not a GGUF file)"
    if llama_cpp_version() is None:
        return "llama.cpp: not run (llama-cpp-python is not installed; `make bench-peers`)"
    import torch
    from llama_cpp import Llama

    n_ctx = max(*args.prompt_lens, max(args.contexts) + WARMUP_STEPS + args.decode_steps + 2)
    _log("llama.cpp: loading the same GGUF")
    llm = Llama(
        model_path=str(source.path), n_ctx=n_ctx, n_batch=max(args.prompt_lens),
        n_ubatch=max(args.prompt_lens), n_threads=threads, n_threads_batch=threads,
        verbose=False,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(SEED)
    vocab = llm.n_vocab()
    for row in [r for r in rows if r.quantization == rows[0].quantization]:
        if row.phase == "decode" and row.size != 1:
            continue
        _log(f"llama.cpp {row.label}")
        if row.phase == "prefill":
            samples = common.sample_times(
                functools.partial(_cpp_prefill, llm, gen, row.size, vocab), args.repeats
            )
        else:
            c = row.nominal_context
            samples = [
                _cpp_decode(llm, gen, c, args.decode_steps, vocab) for _ in range(args.repeats + 1)
            ][1:]
        for same in _same_point(rows, row):
            same.cpp_samples_s = samples
            same.cpp_seconds = statistics.median(samples)
            same.cpp_tokens_per_s = row.size / same.cpp_seconds
    return f"llama.cpp: llama-cpp-python {llama_cpp_version()}, decode at batch 1 only"


def _cpp_prefill(llm: Any, gen: torch.Generator, n: int, vocab: int) -> float:
    llm.reset()
    ids = common.random_ids(gen, n, vocab)
    return common.timed(lambda: llm.eval(ids))


def _cpp_decode(llm: Any, gen: torch.Generator, context: int, steps: int, vocab: int) -> float:
    """Seconds per single-token eval after `context` tokens (+ a warm-up token)."""
    llm.reset()
    llm.eval(common.random_ids(gen, context + WARMUP_STEPS, vocab))
    tokens = common.random_ids(gen, steps, vocab)
    t0 = time.perf_counter()
    for t in tokens:
        llm.eval([t])
    return (time.perf_counter() - t0) / steps


# --------------------------------------------------------------------------- targets


def _find(rows: list[Row], phase: str, size: int, context: int | None = None) -> Row | None:
    return next(
        (
            r
            for r in rows
            if r.phase == phase and r.size == size and context in (None, r.nominal_context)
        ),
        None,
    )


def evaluate_targets(rows: list[Row]) -> list[common.Target]:
    out: list[common.Target] = []
    for q in dict.fromkeys(r.quantization for r in rows):
        out += [
            common.Target(f"[{q}] {t.name}", t.measured, t.met)
            for t in _targets_of([r for r in rows if r.quantization == q])
        ]
    return out


def _targets_of(rows: list[Row]) -> list[common.Target]:
    decodes = [r for r in rows if r.phase == "decode"]
    low = min((r.nominal_context for r in decodes), default=0)
    prefill = _find(rows, "prefill", TARGET_PREFILL_LEN)
    d1 = _find(rows, "decode", 1, TARGET_CONTEXT)
    b, factor = TARGET_BATCH_SCALING
    long_c, short_c, growth = TARGET_CONTEXT_GROWTH
    ratios = [r.ratio for r in rows if r.ratio is not None]
    cpp_prefill = [r.cpp_ratio for r in rows if r.phase == "prefill" and r.cpp_ratio is not None]
    return [
        common.Target(
            f"prefill MFU at {TARGET_PREFILL_LEN} tokens >= {TARGET_PREFILL_MFU:.0%}",
            f"{prefill.utilization:.1%}" if prefill else "not run",
            prefill.utilization >= TARGET_PREFILL_MFU if prefill else None,
        ),
        common.Target(
            f"decode B=1 C={TARGET_CONTEXT} MBU >= {TARGET_DECODE_MBU:.0%}",
            f"{d1.utilization:.1%}" if d1 else "not run",
            d1.utilization >= TARGET_DECODE_MBU if d1 else None,
        ),
        _ratio_target(
            f"decode B=1 C={TARGET_CONTEXT} faster per token than llama.cpp",
            d1.cpp_ratio if d1 else None,
            1.0,
            strict=True,
        ),
        _ratio_target(
            f"prefill tokens/s >= {TARGET_PREFILL_VS_CPP:g}x llama.cpp (every length)",
            min(cpp_prefill) if cpp_prefill else None,
            TARGET_PREFILL_VS_CPP,
        ),
        _scaling_target(_find(rows, "decode", 1, low), _find(rows, "decode", b, low), b, factor),
        _growth_target(_find(rows, "decode", 1, long_c), _find(rows, "decode", 1, short_c), growth),
        common.Target(
            "never slower than transformers (every pdserve/HF >= 1)",
            f"min {min(ratios):.2f}x" if ratios else "not run",
            min(ratios) >= 1.0 if ratios else None,
        ),
    ]


def _ratio_target(
    name: str, ratio: float | None, need: float, strict: bool = False
) -> common.Target:
    if ratio is None:
        return common.Target(name, "not run", None)
    met = ratio > need if strict else ratio >= need
    return common.Target(name, f"{ratio:.2f}x", met)


def _scaling_target(d1: Row | None, db: Row | None, b: int, factor: float) -> common.Target:
    name = f"decode B={b} tokens/s >= {factor:g}x B=1"
    if d1 is None or db is None:
        return common.Target(name, "not run", None)
    gain = db.tokens_per_s / d1.tokens_per_s
    return common.Target(f"{name} (C={d1.nominal_context})", f"{gain:.2f}x", gain >= factor)


def _growth_target(long: Row | None, short: Row | None, limit: float) -> common.Target:
    long_c, short_c, _ = TARGET_CONTEXT_GROWTH
    name = f"decode B=1 step at C={long_c} <= {limit:g}x the step at C={short_c}"
    if long is None or short is None:
        return common.Target(name, "not run", None)
    growth = long.seconds / short.seconds
    return common.Target(name, f"{growth:.2f}x", growth <= limit)


# --------------------------------------------------------------------------- report


def machine_info(threads: int) -> dict[str, Any]:
    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = "not installed"
    return common.machine_info(threads, transformers=hf_version, llama_cpp=llama_cpp_version())


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
    invoked = common.invoked_as("engine")
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
        "MFU = model FLOPs / time / fp32 matmul FLOP/s (int8 rows too); MBU = (weight bytes as "
        "stored + KV bytes) / step time / read GB/s; attn = share of the decode step inside "
        "paged attention (a separate timed run); HF decode is a greedy forward loop with its KV "
        "cache (not `generate`); llama.cpp decodes one sequence. Formulas: "
        "`pdserve.bench.micro.engine_bench`.",
        "",
    ]
    return "\n".join(lines)


def _header(rep: Report) -> list[str]:
    m, roof, model, st = rep.machine, rep.roofline, rep.model, rep.settings
    ends = (m["load_average"], m.get("load_average_end", m["load_average"]))
    load = "/".join(f"{x[0]:.2f}" for x in ends)
    weights = ", ".join(f"{q} {b / 1e6:.0f} MB" for q, b in model["weight_bytes_per_step"].items())
    return [
        f"- date: {rep.date}",
        f"- command: `{rep.command}`",
        f"- model: {model['name']} ({model['source']}, {model['dtype']}, {model['layers']} "
        f"layers, {model['matmul_params'] / 1e6:.1f} M matmul params; weights read per decode "
        f"step: {weights})",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads used, "
        f"torch {m['torch']}, transformers {m['transformers']}, "
        f"llama-cpp-python {m.get('llama_cpp') or 'not installed'}, "
        f"load average (1 min) at start/end {load}",
        f"- roofline (torch, {m['threads']} threads, {BANDWIDTH_MIB} MiB buffers): matmul "
        f"{roof.matmul_gflops:.1f} GFLOP/s ({MATMUL_N}x{MATMUL_N} fp32); read "
        f"{roof.read_gbs:.1f} GB/s (bytes read / time, best of torch.sum "
        f"{roof.sum_gbs:.1f} and matvec {roof.matvec_gbs:.1f}: the MBU reference); copy "
        f"{roof.copy_gbs:.1f} GB/s ((read + written) / time)",
        f"- decode: requests admitted with C tokens of random KV, {WARMUP_STEPS} warm-up + "
        f"{st['decode_steps']} timed steps; every number is a median of {st['repeats']} runs",
        *(f"- {note}" for note in rep.notes),
    ]


def _noise_note(rows: list[Row]) -> list[str]:
    noisy = [
        f"{r.quantization} {r.label} ({r.spread:.1f}x)" for r in rows if r.spread > NOISY_SPREAD
    ]
    above = [f"{r.quantization} {r.label}" for r in rows if r.utilization > 1.0]
    notes = []
    if noisy:
        notes.append(f"Noisy (slowest/fastest repeat > {NOISY_SPREAD}x): {', '.join(noisy)}.")
    if above:
        notes.append(
            f"Above 100% of the roofline: {', '.join(above)}; the roofline was measured while "
            "the machine was busier than during that row, or the data fit in cache."
        )
    return ["", *notes] if notes else []


def _results_table(rows: list[Row]) -> list[str]:
    out = [
        "| run | weights | pdserve tok/s | pdserve ms | HF tok/s | llama.cpp tok/s | "
        "pdserve/HF | pdserve/llama.cpp | MFU / MBU | attn |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kind = "MFU" if r.phase == "prefill" else "MBU"
        out.append(
            f"| {r.label} | {r.quantization} | {r.tokens_per_s:.1f} | {r.seconds * 1e3:.1f} | "
            f"{_fmt(r.hf_tokens_per_s, '.1f')} | {_fmt(r.cpp_tokens_per_s, '.1f')} | "
            f"{_fmt(r.ratio, '.2f')} | {_fmt(r.cpp_ratio, '.2f')} | "
            f"{kind} {r.utilization:.1%} | {_fmt(r.attention_share, '.0%')} |"
        )
    return out


def report_json(rep: Report) -> dict[str, Any]:
    data = asdict(rep)
    for row, raw in zip(rep.rows, data["rows"], strict=True):
        raw.update(label=row.label, ratio=row.ratio, cpp_ratio=row.cpp_ratio, spread=row.spread)
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
    rows: list[Row] = []
    model: dict[str, Any] = {}
    source: ModelSource | None = None
    for q in args.quantization:
        _log(f"loading pdserve engine (quantization {q})")
        engine = build_engine(args, threads, q)
        cost = ModelCost.from_arch(engine.arch, engine.dtype.itemsize)
        rows += run_pdserve(args, engine, cost, roof)
        source, model = engine.source, model or model_info(engine, cost)
        from pdserve.engine.quant import projection_bytes

        model["weight_bytes_per_step"][q] = projection_bytes(engine.model)
        del engine
        gc.collect()
    assert source is not None
    if not args.no_hf:
        run_hf(args, source, rows)
    notes = [] if args.no_llama_cpp else [run_llama_cpp(args, source, threads, rows)]
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
        notes=notes,
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
