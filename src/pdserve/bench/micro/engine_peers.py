"""`pdserve bench engine`'s peers on the same weights and threads: Hugging Face transformers
(prefill and batched decode) and llama.cpp (prefill and batch-1 decode, when installed). Each
is measured once per point and its numbers are shown beside every quantization's row. The method
is in `pdserve.bench.micro.engine_bench`."""

from __future__ import annotations

import argparse
import functools
import inspect
import statistics
import time
from typing import TYPE_CHECKING, Any

from pdserve.bench import common
from pdserve.bench.micro.engine_results import SEED, WARMUP_STEPS, DecodePoint, Row, log

if TYPE_CHECKING:
    import torch

    from pdserve.engine.loader import ModelSource


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

    log("transformers: loading the same weights")
    hf = HFRunner(load_hf(source))
    gen = torch.Generator().manual_seed(SEED)
    for row in [r for r in rows if r.quantization == rows[0].quantization]:
        if row.phase == "decode" and row.size * row.nominal_context > args.hf_max_kv_tokens:
            continue
        log(f"transformers {row.label}")
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
    log("llama.cpp: loading the same GGUF")
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
        log(f"llama.cpp {row.label}")
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
