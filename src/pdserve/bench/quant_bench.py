"""`pdserve bench quant`: how far quantized weights move the model's outputs from float32,
side by side with llama.cpp's own quantized path on the same GGUF, in one run.

Prompts: `--num-prompts` real chat prompts (`bench codec`'s English prompts as the user turn of
the model's chat template), greedy, `--max-tokens` tokens each, EOS ignored so every prompt
yields the same number of tokens, prefix caching off. The reference is pdserve with
`--quantization none` (float32 weights: a GGUF's blocks dequantized exactly).
  * agreement = share of generated tokens before the first divergence from the reference:
    sum over prompts of the common prefix length / sum of reference lengths;
  * token match = share of positions with the reference's token (as `bench codec`);
  * KL = mean over prompts and steps 0..K-1 (K = `--kl-steps`) of KL(p_ref || p_candidate) in
    nats over the whole vocabulary, teacher-forced: the candidate is fed the reference's tokens,
    so each distribution sees the reference's context.
Candidates (`--variants`):
  * int8: what `--quantization int8` runs (every projection and the LM head);
  * int8-head-f32: the same with the LM head left in float32;
  * int8-act8: full 8-bit activations (`reduce_range` off; AVX2 int16 saturation not guarded);
  * w8-fake: int8 weights per output channel, float32 activations (fake-quantized: weight
    error alone);
  * w8g32-fake: int8 weights with one scale per 32 inputs and int8 activations per token,
    fake-quantized (what group-wise scales would buy; no fast kernel runs it);
  * w8g32: what `--quantization w8g32` runs (the real kernel, kernels/w8g32.cpp): int8 weights,
    one fp16 scale per 32 inputs per output channel, float32 activations, LM head included;
  * w8g32-head-f32: the same with the LM head left in float32;
  * w8a8: what `--quantization w8a8` runs (kernels/w8a8.cpp): w8g32's weights times int8
    activations with one scale per 32 inputs per row, LM head included, q|k|v on w8g32
    (float32 activations: quantize.W8A8_FLOAT_ACTIVATIONS);
  * w8a8-all: every projection and the LM head on int8 activations;
  * w8a8-g32-P (P one of qkv, o, gate_up, down, head): w8a8-all with projection P on w8g32
    (float32 activations): which projection's activation rounding costs the most;
  * gguf: what `--quantization gguf` runs: the file's own Q4_1 projections on kernels/q4_1.cpp
    and its Q8_0 LM head on w8g32 (engine/linear/gguf.py), float32 activations;
  * gguf-a8: what `--quantization gguf-a8` runs: the same file tensors times int8 activations
    per 32 inputs (kernels/w8a8.cpp's matmul_q4_1, the head on w8a8), q|k|v on float32
    activations (llama.cpp's own method, but for q|k|v);
  * gguf-a16: what `--quantization gguf-a16` runs: the same file tensors times int16 activations
    per 32 inputs (kernels/w8a8.cpp's matmul_q4_1_a16), every Q4_1 projection; the Q8_0 head
    as under gguf;
  * bf16x3, gguf-a16+bf16x3+kv-float16: the same with `--prefill-format bf16x3` (AMX only:
    three bfloat16 tile products a projection, float32 out; fresh prompts' attention on AMX
    tiles, bf16x3 scores): what `auto` picks on a CPU with AMX;
  * kv-float16, kv-bfloat16: float32 weights over a float16 / bfloat16 KV cache (what
    `--kv-cache-dtype` runs); w8g32+kv-float16, w8a8+kv-float16, gguf(-a8, -a16)+kv-float16:
    both (the first is what `--quantization w8g32` runs by default:
    config.FLOAT16_KV_QUANTIZATIONS). Every other variant keeps a float32 KV cache: the weights
    alone.
llama.cpp (llama-cpp-python, when installed): the same token ids, greedy (`temp=0`) for the
agreement; `logits_all` over prompt + reference tokens for the KL. Its Q4_1 matmuls quantize
activations to 8 bits per block of 32 (Q8_1) and use the file's own 4-bit weights.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.bench.harness import report
from pdserve.percentiles import percentile

if TYPE_CHECKING:
    import torch

    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.llm import LLM

DEFAULT_OUTPUT = Path("docs/benchmarks/quant.md")
VARIANTS = (
    "int8",
    "int8-head-f32",
    "int8-act8",
    "w8-fake",
    "w8g32-fake",
    "w8g32",
    "w8g32-head-f32",
    "w8a8",
    "w8a8-all",
    "w8a8-g32-qkv",
    "w8a8-g32-o",
    "w8a8-g32-gate_up",
    "w8a8-g32-down",
    "w8a8-g32-head",
    "kv-float16",
    "kv-bfloat16",
    "w8g32+kv-float16",
    "w8a8+kv-float16",
    "gguf",
    "gguf+kv-float16",
    "gguf-a8",
    "gguf-a8+kv-float16",
    "gguf-a16",
    "gguf-a16+kv-float16",
    "bf16",
    "gguf-a16+bf16+kv-float16",
    "bf16x3",
    "gguf-a16+bf16x3+kv-float16",
)
HEAD_F32 = ("int8-head-f32", "w8g32-head-f32")
BLOCK_SIZE = 16


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _variants(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"variants must be among {', '.join(VARIANTS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a .gguf; default: SmolLM2-135M Q4_1")
    parser.add_argument("--threads", type=_positive, default=2, help="threads, both engines (2)")
    parser.add_argument("--num-prompts", type=_positive, default=60, help="chat prompts (60)")
    parser.add_argument("--max-tokens", type=_positive, default=64, help="greedy tokens (64)")
    parser.add_argument("--kl-steps", type=_positive, default=16, help="KL over steps 0..K-1")
    parser.add_argument(
        "--variants", type=_variants, default=list(VARIANTS), help=f"{','.join(VARIANTS)}"
    )
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp column")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="markdown report")
    parser.add_argument("--json", type=Path, default=None, help="also write results as JSON")


@dataclass
class Quality:
    name: str
    agreement: float  # tokens before the first divergence / reference tokens
    token_match: float  # positions equal to the reference / reference tokens
    identical: int  # prompts whose whole output equals the reference's
    kl_mean: float
    kl_p90: float
    seconds: float  # wall time of the free run (context only: not a speed benchmark)


# --------------------------------------------------------------------------- variants


class _FakeQuant:
    """x -> (per-token int8 fake-quant of x, if `act`) @ (dequantized int8 weights) + bias."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, group: int, act: bool) -> None:
        import torch

        k = w.shape[0]
        g = group if group and k % group == 0 else k
        blocks = w.reshape(k // g, g, w.shape[1])  # [groups, g, out]: scale per (group, out)
        scale = (blocks.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12)
        self.w = (torch.round(blocks / scale) * scale).reshape_as(w)
        self.bias, self.act = bias, act
        self.nbytes = w.numel()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        import torch

        if self.act:
            s = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(1e-30)
            x = torch.round(x / s) * s
        y = x @ self.w
        y = y if self.bias is None else y + self.bias
        return y if residual is None else residual + y


def _projection(variant: str, w: torch.Tensor, bias: torch.Tensor | None, proj: str) -> Any:
    """`variant`'s stand-in for projection `proj` (a LAYER_PROJECTIONS name or "head")."""
    from pdserve.engine.linear.int8 import Int8Linear
    from pdserve.engine.linear.w8a8 import W8A8Linear
    from pdserve.engine.linear.w8g32 import W8G32Linear
    from pdserve.engine.quantize import quantize

    if variant == "w8a8":
        return quantize("w8a8", w, bias, proj)
    if variant in ("w8g32", "w8g32-head-f32") or variant == f"w8a8-g32-{proj}":
        return W8G32Linear(w, bias)
    if variant.startswith("w8a8"):
        return W8A8Linear(w, bias)
    if variant in ("int8", "int8-head-f32"):
        return Int8Linear(w, bias)
    if variant == "int8-act8":
        return Int8Linear(w, bias, reduce_range=False)
    if variant == "w8-fake":
        return _FakeQuant(w, bias, group=0, act=False)
    return _FakeQuant(w, bias, group=32, act=True)


def _set_kv_dtype(engine: LLMEngine, name: str) -> None:
    """Reallocate the (idle, prefix-cache-free) engine's KV tensors in dtype `name`."""
    import torch

    dtype = getattr(torch, name)
    cache = engine.cache
    if cache.dtype != dtype:
        cache.layers = [(torch.zeros_like(k, dtype=dtype), torch.zeros_like(v, dtype=dtype))
                        for k, v in cache.layers]  # fmt: skip
        cache.dtype = dtype


def apply_variant(engine: LLMEngine, variant: str | None) -> None:
    """Swap the model's projections for `variant`'s (None: back to float32) and its KV cache's
    dtype; the float weights stay, so one loaded model serves every variant."""
    from pdserve.engine import quantize
    from pdserve.engine.linear.base import FusedOps

    weights, _, kv = (variant or "").partition("kv-")
    _set_kv_dtype(engine, kv or "float32")
    weights = weights.removesuffix("+")
    prefill = next((f for f in ("bf16x3", "bf16") if weights.endswith(f)), "")
    variant = weights.removesuffix(prefill).removesuffix("+") or None
    model = engine.model
    # The real w8g32 / w8a8 / gguf variants run what `--quantization` runs: its native RMSNorm /
    # RoPE too.
    file = variant in quantize.GGUF_QUANTIZATIONS  # the GGUF file's own tensors
    real = file or variant in ("w8g32", "w8g32-head-f32") or (variant or "").startswith("w8a8")
    fused = FusedOps() if real else None
    model.fused = fused
    for i, layer in enumerate(quantize.layers_of(model)):
        layer.fused = fused
        layer.quantized.clear()
        if variant is None:
            continue
        for proj in quantize.LAYER_PROJECTIONS:
            bias = layer.qkv_bias if proj == "qkv" else None
            w = getattr(layer, proj)
            layer.quantized[proj] = (
                _file_projection(engine, i, proj, w, bias, quantize.activations_of(variant, proj))
                if file
                else _projection(variant, w, bias, proj)
            )
    _prefill_copies(engine, prefill)
    head = variant is not None and variant not in HEAD_F32
    if file:
        acts = quantize.activations_of(variant or "", "head")
        model.quantized_head = _file_projection(engine, -1, "head", model.lm_head, None, acts)
    else:
        model.quantized_head = _projection(variant, model.lm_head, None, "head") if head else None  # type: ignore[arg-type]


def _prefill_copies(engine: LLMEngine, kind: str) -> None:
    """Prompt rows on `kind` (bf16 | bf16x3) copies beside the projections just set, attached
    as `--prefill-format` attaches them; "" for none."""
    from pdserve.engine import prefill_format as pf
    from pdserve.engine.quantize import layers_of

    model = engine.model
    model.step_rows = None
    for layer in layers_of(model):
        layer.prompt_weights = None
    if kind:
        pf.attach(model, pf.make_copies(model, kind), kind, "both", pf.probe_units())


_FILE_WEIGHTS: dict[int, Any] = {}


def _file_projection(
    engine: LLMEngine,
    layer: int,
    proj: str,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    activations: str = "float",
) -> Any:
    """What `--quantization gguf` (gguf-a8, gguf-a16: `activations`) runs for projection `proj`
    of `layer` (-1: the LM head); the file's tensors are read once per engine."""
    from pdserve.engine import quantize
    from pdserve.engine.linear import gguf

    if id(engine) not in _FILE_WEIGHTS:
        _FILE_WEIGHTS.clear()
        _FILE_WEIGHTS[id(engine)] = quantize.gguf_weights(engine.source, engine.arch)
    tensors = _FILE_WEIGHTS[id(engine)]
    parts = [tensors[n] for n in quantize.file_tensor_names(engine.model, layer, proj)]
    return gguf.projection(parts, w, bias, f"{proj} of layer {layer}", activations)


# --------------------------------------------------------------------------- measuring


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float, int]:
    """(tokens before the first divergence, positions equal, identical outputs) vs `ref`."""
    total = sum(len(r) for r in ref)
    prefix = same = identical = 0
    for r, g in zip(ref, got, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(r, g, strict=False)) if a != b), len(r))
        prefix += min(n, len(g))
        same += sum(a == b for a, b in zip(r, g, strict=False))
        identical += r == g
    return prefix / total, same / total, identical


def _kl(base: Sequence[torch.Tensor], other: Sequence[torch.Tensor]) -> list[float]:
    from pdserve.bench.micro.codec_quality import kl_divergences

    return kl_divergences(list(base), list(other))


def pdserve_run(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, kl_steps: int, tag: str,
    force: list[list[int]] | None,
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:  # fmt: skip
    """Greedy outputs and the log-softmax rows of steps 0..kl_steps-1 (forced: teacher-forced
    with `force`, cut after kl_steps)."""
    from pdserve.bench.micro.codec_quality import ProbeSampler, run_batch

    forced = None if force is None else {f"{tag}-{i}": f for i, f in enumerate(force)}
    probe = ProbeSampler(range(kl_steps), forced)
    stop = kl_steps if force is not None else None
    res = run_batch(engine, prompts, max_tokens, None, probe, tag, stop_after=stop)
    n = len(prompts)
    return [res.tokens[i] for i in range(n)], [res.logprobs.get(i, []) for i in range(n)]


class LlamaCpp:
    """llama-cpp-python on the same GGUF: greedy generation and teacher-forced logits."""

    def __init__(self, path: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
            logits_all=True, verbose=False, seed=0,
        )  # fmt: skip

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        out: list[int] = []
        for tok in self.llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) == n:
                break
        return out

    def logprobs(self, prompt: list[int], ref: list[int], steps: int) -> list[torch.Tensor]:
        import torch

        self.llm.reset()
        self.llm.eval(prompt + ref[: steps - 1])
        rows = torch.from_numpy(self.llm.scores[len(prompt) - 1 : len(prompt) - 1 + steps].copy())
        return list(torch.log_softmax(rows.float(), dim=-1))


def _quality(
    name: str, ref: list[list[int]], got: list[list[int]], ref_lp: Any, lp: Any, seconds: float
) -> Quality:
    agree, match, identical = agreement(ref, got)
    kls = [k for a, b in zip(ref_lp, lp, strict=True) for k in _kl(a, b)]
    return Quality(
        name, agree, match, identical, statistics.fmean(kls), percentile(kls, 90), seconds
    )


def measure(args: argparse.Namespace, engine: LLMEngine, prompts: list[list[int]]) -> list[Quality]:
    n, k = args.max_tokens, min(args.kl_steps, args.max_tokens)
    report.log(f"reference (float32): {len(prompts)} prompts x {n} tokens", "bench quant")
    t0 = time.perf_counter()
    ref, ref_lp = pdserve_run(engine, prompts, n, k, "ref", None)
    results = [_quality("none (reference)", ref, ref, ref_lp, ref_lp, time.perf_counter() - t0)]
    for variant in args.variants:
        report.log(variant, "bench quant")
        apply_variant(engine, variant)
        t0 = time.perf_counter()
        got, _ = pdserve_run(engine, prompts, n, k, f"{variant}-free", None)
        seconds = time.perf_counter() - t0
        _, lp = pdserve_run(engine, prompts, n, k, f"{variant}-forced", ref)
        results.append(_quality(variant, ref, got, ref_lp, lp, seconds))
        report.log(
            f"{variant}: {results[-1]}", "bench quant"
        )  # partial results survive an interrupted run
    apply_variant(engine, None)
    if not args.no_llama_cpp:
        results += _llama_cpp(args, engine, prompts, ref, ref_lp, k)
    return results


def _llama_cpp(
    args: argparse.Namespace, engine: LLMEngine, prompts: list[list[int]],
    ref: list[list[int]], ref_lp: Any, k: int,
) -> list[Quality]:  # fmt: skip
    if engine.source.kind != "gguf":
        report.log("llama.cpp skipped: the model is not a GGUF file", "bench quant")
        return []
    try:
        cpp = LlamaCpp(engine.source.path, args.threads, max(map(len, prompts)) + args.max_tokens)
    except ImportError:
        report.log(
            "llama.cpp skipped: llama-cpp-python is not installed (`make bench-peers`)",
            "bench quant",
        )
        return []
    report.log("llama.cpp (llama-cpp-python)", "bench quant")
    t0 = time.perf_counter()
    got = [cpp.greedy(p, args.max_tokens) for p in prompts]
    seconds = time.perf_counter() - t0
    lp = [cpp.logprobs(p, r, k) for p, r in zip(prompts, ref, strict=True)]
    return [_quality("llama.cpp (the GGUF's own weights)", ref, got, ref_lp, lp, seconds)]


# --------------------------------------------------------------------------- report


def _chat_prompts(llm: LLM, n: int) -> list[list[int]]:
    from pdserve.bench.micro.codec_quality import bench_prompts

    return [llm.apply_chat_template([{"role": "user", "content": t}]) for t in bench_prompts(n)]


def render_markdown(rep: dict[str, Any]) -> str:
    m, s = rep["machine"], rep["settings"]
    lines = [
        "# Quantized weights: agreement with float32",
        "",
        *report.head_lines(report.ReportHead(rep["date"], rep["command"], m)),
        f"- model: {rep['model']}",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads, torch {m['torch']}, "
        f"llama-cpp-python {m['llama_cpp']}, load average (1 min) at start/end "
        f"{report.load_span(m)}",
        f"- {s['num_prompts']} chat prompts ({min(rep['prompt_lens'])}-{max(rep['prompt_lens'])} "
        f"tokens), {s['max_tokens']} greedy tokens each (EOS ignored), KL teacher-forced over "
        f"steps 0-{s['kl_steps'] - 1}",
        "",
        "| run | agreement (tokens before 1st divergence) | token match | identical outputs | "
        "mean KL (nats) | p90 KL | free-run s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for q in rep["quality"]:
        lines.append(
            f"| {q['name']} | {q['agreement']:.1%} | {q['token_match']:.1%} | "
            f"{q['identical']}/{s['num_prompts']} | {q['kl_mean']:.2e} | {q['kl_p90']:.2e} | "
            f"{q['seconds']:.1f} |"
        )
    lines += ["", "Method and variants: `pdserve.bench.quant_bench` (module docstring).", ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from pdserve import LLM

    date = report.now()
    torch.set_num_threads(args.threads)
    cpp_version = report.version_of("llama_cpp") or "not installed"
    machine = report.machine_info(args.threads, llama_cpp=cpp_version)
    # quantization="none": the reference is float32 and every variant is built from the float
    # weights (the default, auto, would load the file's own weights and free the floats).
    llm = LLM(
        args.model, threads=args.threads, block_size=BLOCK_SIZE, enable_prefix_caching=False,
        max_num_seqs=args.num_prompts, kv_cache_memory_gb=2.0, quantization="none",
    )  # fmt: skip
    engine = llm.engine
    prompts = _chat_prompts(llm, args.num_prompts)
    quality = measure(args, engine, prompts)
    machine["load_average_end"] = report.load_average()
    rep = {
        "date": date,
        "command": report.command_line(None),
        "machine": machine,
        "model": f"{engine.arch.name} ({engine.source.path.name})",
        "settings": {k: getattr(args, k) for k in ("num_prompts", "max_tokens", "threads")}
        | {"kl_steps": min(args.kl_steps, args.max_tokens), "variants": args.variants},
        "prompt_lens": [len(p) for p in prompts],
        "quality": [asdict(q) for q in quality],
    }
    report.write_report(render_markdown(rep), rep, args.output, args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.bench.quant_bench", description=__doc__
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
