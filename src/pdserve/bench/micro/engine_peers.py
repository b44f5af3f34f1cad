"""`pdserve bench engine`'s peers on the same weights and threads: Hugging Face transformers
(prefill and batched decode) and llama.cpp (prefill and batch-1 decode, when installed), each a
side of the rounds (`engine_bench.run_rounds`). Each is measured once per point and round, and
its numbers are shown beside every quantization's row. The method is in
`pdserve.bench.micro.engine_bench`."""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from typing import TYPE_CHECKING, Any

from pdserve.bench.harness import report, timing
from pdserve.bench.micro.engine_results import (
    SEED,
    WARMUP_STEPS,
    DecodePoint,
    Key,
    Row,
    key_label,
)

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


class HFSystem:
    """Transformers as a side of the rounds: every prompt length, and the decode points whose
    B * C is within --hf-max-kv-tokens (its cache grows by concatenation)."""

    name = "transformers"

    def __init__(self, args: argparse.Namespace, source: ModelSource, points: list[Key]) -> None:
        import torch

        report.log("transformers: loading the same weights")
        self.hf = HFRunner(load_hf(source))
        self.gen = torch.Generator().manual_seed(SEED)
        self.keys = [
            k
            for k in points
            if not isinstance(k[1], DecodePoint)
            or k[1].batch * k[1].context <= args.hf_max_kv_tokens
        ]

    def once(self, key: Key) -> float:
        import torch

        what = key[1]
        if isinstance(what, DecodePoint):
            return _hf_decode_once(self.hf, what, self.gen)
        ids = torch.tensor([timing.random_ids(self.gen, what, self.hf.model.config.vocab_size)])
        with torch.inference_mode():
            return timing.timed(lambda: self.hf.prefill(ids))


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
    token = torch.tensor([timing.random_ids(gen, point.batch, cfg.vocab_size)]).t()  # [B, 1]
    with torch.inference_mode():
        state: list[Any] = [token, cache]

        def step() -> None:
            state[0], state[1] = hf.decode(state[0], state[1])

        for _ in range(WARMUP_STEPS):
            step()
        return timing.timed(step, point.steps) / point.steps


def attach_peer(rows: list[Row], side: str, samples: dict[Key, list[float]]) -> None:
    """A peer's samples ("hf" or "cpp") beside every quantization's row of the same point."""
    by_label = {key_label(k): v for k, v in samples.items()}
    for row in rows:
        got = by_label.get(row.label)
        if not got:
            continue
        seconds = statistics.median(got)
        setattr(row, f"{side}_samples_s", got)
        setattr(row, f"{side}_seconds", seconds)
        setattr(row, f"{side}_tokens_per_s", row.size / seconds)


# --------------------------------------------------------------------------- llama.cpp


def llama_cpp_system(
    args: argparse.Namespace, source: ModelSource, threads: int, points: list[Key]
) -> tuple[CppSystem | None, str]:
    """llama.cpp as a side of the rounds (or None), and a note on what ran."""
    if source.kind != "gguf":
        return None, "llama.cpp: not run (the model is not a GGUF file)"
    if report.version_of("llama_cpp") is None:
        return None, "llama.cpp: not run (llama-cpp-python is not installed; `make bench-peers`)"
    note = f"llama.cpp: llama-cpp-python {report.version_of('llama_cpp')}, decode at batch 1 only"
    return CppSystem(args, source, threads, points), note


class CppSystem:
    """llama.cpp: every prompt length, decode at batch 1 (the Python API runs one sequence)."""

    name = "llama.cpp"

    def __init__(
        self, args: argparse.Namespace, source: ModelSource, threads: int, points: list[Key]
    ) -> None:
        import torch
        from llama_cpp import Llama

        n_ctx = max(*args.prompt_lens, max(args.contexts) + WARMUP_STEPS + args.decode_steps + 2)
        report.log("llama.cpp: loading the same GGUF")
        self.llm = Llama(
            model_path=str(source.path), n_ctx=n_ctx, n_batch=max(args.prompt_lens),
            n_ubatch=max(args.prompt_lens), n_threads=threads, n_threads_batch=threads,
            verbose=False,
        )  # fmt: skip
        self.gen = torch.Generator().manual_seed(SEED)
        self.vocab = self.llm.n_vocab()
        self.keys = [k for k in points if not isinstance(k[1], DecodePoint) or k[1].batch == 1]

    def once(self, key: Key) -> float:
        what = key[1]
        if isinstance(what, DecodePoint):
            return _cpp_decode(self.llm, self.gen, what.context, what.steps, self.vocab)
        return _cpp_prefill(self.llm, self.gen, what, self.vocab)


def _cpp_prefill(llm: Any, gen: torch.Generator, n: int, vocab: int) -> float:
    llm.reset()
    ids = timing.random_ids(gen, n, vocab)
    return timing.timed(lambda: llm.eval(ids))


def _cpp_decode(llm: Any, gen: torch.Generator, context: int, steps: int, vocab: int) -> float:
    """Seconds per single-token eval after `context` tokens (+ a warm-up token)."""
    llm.reset()
    llm.eval(timing.random_ids(gen, context + WARMUP_STEPS, vocab))
    tokens = timing.random_ids(gen, steps, vocab)
    t0 = time.perf_counter()
    for t in tokens:
        llm.eval([t])
    return (time.perf_counter() - t0) / steps
