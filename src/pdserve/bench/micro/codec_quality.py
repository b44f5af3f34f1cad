"""`pdserve bench codec`'s quality half: the fixed prompts, the engine hooks (a probing sampler
and the prompt KV's wire round trip) and the token-match / KL comparison against a baseline
that keeps its KV. The method is in `pdserve.bench.micro.codec_bench`."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from pdserve.bench.harness import report

if TYPE_CHECKING:
    import torch

    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.request import SamplingParams
    from pdserve.engine.sampler import History, Sampler, SampleResult

KL_STEPS = 16

TOPICS = [
    "photosynthesis", "the French Revolution", "black holes", "compound interest",
    "the immune system", "machine learning", "plate tectonics", "the printing press",
    "climate change", "the human heart", "supply and demand", "the Roman Empire",
]  # fmt: skip
TEMPLATES = [
    "Question: What is {topic}, and why does it matter in everyday life? Answer in two or "
    "three clear sentences that a twelve-year-old could follow.\nAnswer:",
    "You are a patient teacher. A student has asked you to explain {topic}. First give a "
    "one-sentence definition, then describe the most important idea behind it, and finally "
    "mention one common misunderstanding and correct it.\n\nExplanation:",
    "The following is a conversation between a curious visitor and a museum guide.\n"
    "Visitor: Good morning! I saw a sign about an exhibition on {topic}.\n"
    "Guide: Yes, it opened last week, and it has been very popular with families.\n"
    "Visitor: I have always found {topic} confusing. Where should I start?\n"
    "Guide:",
    "Here are some notes a student wrote while studying {topic} for an exam:\n"
    "- The teacher said it is one of the most important topics of the year.\n"
    "- There were three key terms on the board, but I forgot to copy them.\n"
    "- The textbook chapter is long and full of examples and diagrams.\n"
    "- The exam will ask for a short essay and two definitions.\n\n"
    "Write a short study guide on {topic} that lists the key terms, explains each in one "
    "sentence, and ends with a practice question.\n\nStudy guide:",
    "Dear editor,\n\nI am writing because last week's article about {topic} left many of "
    "your readers, including me, with more questions than answers. The article was well "
    "written and the pictures were lovely, but it assumed that everyone already knew the "
    "basics. My neighbour, who is a retired engineer, told me that {topic} is actually much "
    "simpler than the article made it sound, and that a few plain examples would have helped. "
    "My daughter, who is in high school, asked me to explain it to her over dinner, and I "
    "realised that I could not. Could you please publish a short follow-up that explains "
    "{topic} step by step, with one example from daily life, and a list of the three facts "
    "every reader should remember?\n\nYours sincerely,\nA confused reader\n\n"
    "Editor's reply:",
]


def bench_prompts(n: int) -> list[str]:
    """n fixed prompts: template i % 5 on topic i // 5, so any prefix mixes all lengths."""
    combos = [(t, topic) for topic in TOPICS for t in TEMPLATES]
    if n > len(combos):
        raise ValueError(f"at most {len(combos)} prompts are defined, asked for {n}")
    return [t.format(topic=topic) for t, topic in combos[:n]]


@dataclass
class CodecQuality:
    codec: str
    token_match: float  # share of generated tokens equal to the baseline's, same position
    identical_prompts: int  # prompts whose whole output equals the baseline's
    kl_mean: float  # nats, teacher-forced decode steps 1..K
    kl_max: float
    wire_bytes: int  # whole frames of every prompt's KV
    prompt_tokens: int

    @property
    def bytes_per_token(self) -> float:
        return self.wire_bytes / self.prompt_tokens


# --------------------------------------------------------------------------- engine hooks


class ProbeSampler:
    """Stands in for `engine.sampler` during a run: samples with the engine's own sampler, then
    records the log-softmax rows of the positions in `keep` (per request, 0 = the token sampled
    after the prefill) and replaces the token by `force[request_id][position]` if given."""

    def __init__(self, keep: range, force: dict[str, list[int]] | None = None) -> None:
        self.keep, self.force = keep, force or {}
        self.inner: Sampler | None = None  # set by `run_batch`
        self.logprobs: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._position: Counter[str] = Counter()

    def sample(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        histories: Sequence[History] | None = None,
        masks: Sequence[torch.Tensor | None] | None = None,
    ) -> list[SampleResult]:
        import torch

        assert self.inner is not None
        results = self.inner.sample(logits, request_ids, params, histories, masks)
        for row, (rid, result) in enumerate(zip(request_ids, results, strict=True)):
            pos = self._position[rid]
            self._position[rid] += 1
            if pos in self.keep:
                self.logprobs[rid].append(torch.log_softmax(logits[row].float().cpu(), dim=-1))
            forced = self.force.get(rid)
            if forced is not None and pos < len(forced):
                result.token_id = forced[pos]
        return results

    def forget(self, request_id: str) -> None:
        if self.inner is not None:
            self.inner.forget(request_id)


def round_trip_prompt_kv(engine: LLMEngine, request_id: str, num_tokens: int, codec: str) -> int:
    """Send the request's prompt KV through the wire format and back into the cache, as P reads
    it and D stores it (the engine's KV calls); returns the frame's size in bytes."""
    from pdserve.transfer.wire import decode_frame, encode_frame, frame_nbytes

    slots = engine.kv_slots(engine.kv_manager.get_block_ids(request_id), 0, num_tokens)
    kv = [engine.read_kv(slots, layer) for layer in range(engine.kv_layout.num_layers)]
    fingerprint = engine.kv_layout.fingerprint()
    parts = encode_frame(
        request_id, 0, 0, [k for k, _ in kv], [v for _, v in kv], codec, fingerprint
    )
    frame = decode_frame(b"".join(parts), fingerprint=fingerprint)
    for layer, k, v in frame.layers():
        engine.write_kv(slots, layer, k, v)
    return frame_nbytes(parts)


@dataclass
class RunResult:
    tokens: dict[int, list[int]]  # prompt index -> generated tokens
    logprobs: dict[int, list[torch.Tensor]]  # prompt index -> recorded log-softmax rows
    wire_bytes: int = 0


def run_batch(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: int,
    codec: str | None,
    probe: ProbeSampler,
    tag: str,
    stop_after: int | None = None,
) -> RunResult:
    """All prompts as one greedy batch; with a codec, each prompt's KV makes the round trip
    right after the step that sampled its first token. With `stop_after`, the run is cut (the
    requests aborted) once every prompt has that many tokens: the steps up to then have the
    same batches as a full run."""
    from pdserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params, request_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
    index = {rid: i for i, rid in enumerate(rids)}
    original = probe.inner = engine.sampler
    engine.sampler = cast("Sampler", probe)
    preemptions = engine.scheduler.num_preemptions
    result = RunResult({}, {})
    try:
        while engine.has_unfinished_requests() and not _all_reached(result, rids, stop_after):
            for out in engine.step():
                i = index[out.request_id]
                tokens = out.outputs[0].token_ids
                if codec is not None and len(tokens) == 1 and not out.finished:
                    result.wire_bytes += round_trip_prompt_kv(
                        engine, out.request_id, len(prompts[i]), codec
                    )
                result.tokens[i] = tokens
    finally:
        engine.sampler = original
        for rid in rids:
            engine.abort_request(rid)
    if engine.scheduler.num_preemptions != preemptions:
        raise RuntimeError("a request was preempted (its KV recomputed): raise the KV blocks")
    result.logprobs = {index[r]: rows for r, rows in probe.logprobs.items()}
    return result


def _all_reached(result: RunResult, rids: list[str], stop_after: int | None) -> bool:
    if stop_after is None or len(result.tokens) < len(rids):
        return False
    return all(len(t) >= stop_after for t in result.tokens.values())


# --------------------------------------------------------------------------- quality


def kl_divergences(base: list[torch.Tensor], other: list[torch.Tensor]) -> list[float]:
    """KL(p_base || p_other) in nats per position, from log-softmax rows."""
    out = []
    for lp, lq in zip(base, other, strict=True):
        lp64, lq64 = lp.double(), lq.double()
        out.append(float((lp64.exp() * (lp64 - lq64)).sum().clamp_min(0.0)))
    return out


def measure_quality(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, codecs: Sequence[str]
) -> list[CodecQuality]:
    kl_steps = range(1, min(KL_STEPS, max_tokens - 1) + 1)
    report.log(f"baseline: {len(prompts)} prompts x {max_tokens} tokens", "bench codec")
    base = run_batch(engine, prompts, max_tokens, None, ProbeSampler(kl_steps), "base")
    results = []
    for codec in codecs:
        report.log(f"{codec}: free run", "bench codec")
        free = run_batch(engine, prompts, max_tokens, codec, ProbeSampler(range(0)), codec)
        report.log(f"{codec}: teacher-forced run for KL", "bench codec")
        force = {f"{codec}-forced-{i}": base.tokens[i] for i in range(len(prompts))}
        probe = ProbeSampler(kl_steps, force)
        forced = run_batch(
            engine, prompts, max_tokens, codec, probe, f"{codec}-forced", stop_after=kl_steps.stop
        )
        results.append(_quality(codec, base, free, forced, prompts))
    return results


def _quality(
    codec: str, base: RunResult, free: RunResult, forced: RunResult, prompts: list[list[int]]
) -> CodecQuality:
    n = len(prompts)
    pairs = [(base.tokens[i], free.tokens[i]) for i in range(n)]
    same = sum(a == b for ref, got in pairs for a, b in zip(ref, got, strict=True))
    kls = [kl for i in range(n) for kl in kl_divergences(base.logprobs[i], forced.logprobs[i])]
    return CodecQuality(
        codec=codec,
        token_match=same / sum(len(ref) for ref, _ in pairs),
        identical_prompts=sum(ref == got for ref, got in pairs),
        kl_mean=statistics.fmean(kls) if kls else 0.0,
        kl_max=max(kls, default=0.0),
        wire_bytes=free.wire_bytes,
        prompt_tokens=sum(len(p) for p in prompts),
    )
