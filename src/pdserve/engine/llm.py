"""`LLM`, the offline API: `LLM(model).generate(prompts, SamplingParams(...))` or `.chat(...)`,
run to completion on an in-process `LLMEngine`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine, Prompt
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import SamplingParams


class LLM:
    """Offline batch generation: `LLM(model).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        ids = []
        try:
            for prompt, p in zip(batch, params, strict=True):
                ids.append(self.engine.add_request(prompt, p))
        except ValueError:
            for rid in ids:  # lose nothing: a bad prompt leaves no half-added batch behind
                self.engine.abort_request(rid)
            raise
        return self._run_to_completion(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [self.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))

    def _run_to_completion(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Every request's final output; an n-choice request's choices in `outputs`, by index."""
        final: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if not out.finished:
                    continue
                done = final.get(out.request_id)
                if done is None:
                    final[out.request_id] = out
                else:
                    done.outputs = sorted([*done.outputs, *out.outputs], key=lambda c: c.index)
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [final[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="generate")
