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
import datetime
import os
import shlex
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pdserve import argtypes
from pdserve.bench import common

if TYPE_CHECKING:
    import torch

    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.request import SamplingParams
    from pdserve.engine.sampler import Sampler, SampleResult

DEFAULT_OUTPUT = Path("docs/benchmarks/kv_codec.md")
CODEC_NAMES = ("none", "int8", "int4")
KL_STEPS = 16
BLOCK_SIZE = 16
CRC_WARN_GBS = 2.0

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


# --------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser)
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


# --------------------------------------------------------------------------- results


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


@dataclass
class CodecSpeed:
    codec: str
    encode_gbs: float  # uncompressed KV bytes / encode time
    decode_gbs: float  # uncompressed KV bytes / decode time
    frame_gbs: float  # uncompressed KV bytes / (encode_frame + decode_frame + layers())
    ratio: float  # encoded / uncompressed bytes


@dataclass
class Report(common.ReportHead):
    model: dict[str, Any]
    settings: dict[str, Any]
    quality: list[CodecQuality]
    speed: list[CodecSpeed]
    crc32_gbs: float
    prompt_lens: list[int] = field(default_factory=list)


def _log(msg: str) -> None:
    print(f"[bench codec] {msg}", file=sys.stderr, flush=True)


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
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> list[SampleResult]:
        import torch

        assert self.inner is not None
        results = self.inner.sample(logits, request_ids, params)
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


def prompt_slots(block_ids: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """Flat cache rows (block * block_size + offset) of tokens [0, num_tokens)."""
    import torch

    pos = torch.arange(num_tokens)
    table = torch.tensor(block_ids, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size


def round_trip_prompt_kv(engine: LLMEngine, request_id: str, num_tokens: int, codec: str) -> int:
    """Send the request's prompt KV through the wire format and back into the cache, as D would
    receive it; returns the frame's size in bytes."""
    from pdserve.transfer.wire import decode_frame, encode_frame, frame_nbytes, layout_fingerprint

    cache = engine.cache
    slots = prompt_slots(engine.kv_manager.get_block_ids(request_id), cache.block_size, num_tokens)
    slots = slots.to(engine.device)
    flat = [(k.flatten(0, 1), v.flatten(0, 1)) for k, v in cache.layers]  # views of the cache
    fingerprint = layout_fingerprint(engine.arch, engine.dtype)
    parts = encode_frame(
        request_id, 0, 0, [k[slots] for k, _ in flat], [v[slots] for _, v in flat], codec,
        fingerprint,
    )  # fmt: skip
    frame = decode_frame(b"".join(parts), fingerprint=fingerprint)
    for layer, k, v in frame.layers():
        flat[layer][0][slots] = k.to(engine.device, engine.dtype)
        flat[layer][1][slots] = v.to(engine.device, engine.dtype)
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
    _log(f"baseline: {len(prompts)} prompts x {max_tokens} tokens")
    base = run_batch(engine, prompts, max_tokens, None, ProbeSampler(kl_steps), "base")
    results = []
    for codec in codecs:
        _log(f"{codec}: free run")
        free = run_batch(engine, prompts, max_tokens, codec, ProbeSampler(range(0)), codec)
        _log(f"{codec}: teacher-forced run for KL")
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


# --------------------------------------------------------------------------- speed


def measure_speed(
    engine: LLMEngine, tokens: int, codecs: Sequence[str], repeats: int
) -> list[CodecSpeed]:
    import torch

    arch = engine.arch
    gen = torch.Generator().manual_seed(0)
    shape = (tokens, arch.num_kv_heads, arch.head_dim)
    kv = [torch.randn(shape, generator=gen).to(engine.dtype) for _ in range(2 * arch.num_layers)]
    return [_codec_speed(name, kv, repeats) for name in codecs]


def _codec_speed(name: str, kv: list[torch.Tensor], repeats: int) -> CodecSpeed:
    from pdserve.transfer.codecs import get_codec
    from pdserve.transfer.wire import decode_frame, encode_frame, frame_nbytes

    codec = get_codec(name)
    raw = sum(t.nbytes for t in kv)
    n, heads, dim = kv[0].shape
    encoded = [codec.encode(t) for t in kv]

    def gbs(fn: Callable[[], object]) -> float:
        return raw / common.median_seconds(fn, repeats) / 1e9

    def frame_round_trip() -> None:
        parts = encode_frame("speed", 0, 0, kv[0::2], kv[1::2], name, bytes(8))
        for _ in decode_frame(parts).layers():
            pass

    return CodecSpeed(
        codec=name,
        encode_gbs=gbs(lambda: [codec.encode(t) for t in kv]),
        decode_gbs=gbs(lambda: [codec.decode(b, n, heads, dim, kv[0].dtype) for b in encoded]),
        frame_gbs=gbs(frame_round_trip),
        ratio=frame_nbytes(encoded) / raw,
    )


# --------------------------------------------------------------------------- report


def machine_info(threads: int) -> dict[str, Any]:
    return common.machine_info(threads)


def command_line(args: argparse.Namespace) -> str:
    invoked = common.invoked_as("codec")
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


def render_markdown(rep: Report) -> str:
    return "\n".join(
        [
            "# KV codec benchmark",
            "",
            *_header(rep),
            "",
            "## Quality (greedy decoding after the prompt KV's wire round trip)",
            "",
            *_quality_table(rep),
            "",
            "## Speed",
            "",
            *_speed_table(rep),
            "",
            *_method_notes(rep),
            "",
        ]
    )


def _header(rep: Report) -> list[str]:
    m, model, s, lens = rep.machine, rep.model, rep.settings, rep.prompt_lens
    threads_note = "torch's default" if s["threads"] is None else "--threads"
    return [
        f"- date: {rep.date}",
        f"- command: `{rep.command}`",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['threads']} torch threads "
        f"({threads_note}), torch {m['torch']}, python {m['python']}, load average (1 min) "
        f"at start/end {m['load_average'][0]:.2f}/{m['load_average_end'][0]:.2f}",
        f"- model: {model['name']} ({model['dtype']}, {model['layers']} layers, "
        f"{model['kv_heads']} KV heads x head_dim {model['head_dim']})",
        f"- prompts: {len(lens)} ({min(lens)}-{max(lens)} tokens, mean "
        f"{statistics.fmean(lens):.0f}), {s['max_tokens']} greedy tokens each, one batch, "
        f"prefix caching off, KL over decode steps 1-{s['kl_steps']}",
    ]


def _quality_table(rep: Report) -> list[str]:
    none = next((q for q in rep.quality if q.codec == "none"), None)
    rows = [
        "| codec | wire bytes/token | saved vs none | token match | identical outputs "
        f"| mean KL (nats), steps 1-{rep.settings['kl_steps']} | max KL |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for q in rep.quality:
        saved = f"{1 - q.bytes_per_token / none.bytes_per_token:.1%}" if none else "—"
        rows.append(
            f"| {q.codec} | {q.bytes_per_token:,.0f} | {saved} | {q.token_match:.2%} | "
            f"{q.identical_prompts}/{len(rep.prompt_lens)} | {q.kl_mean:.2e} | {q.kl_max:.2e} |"
        )
    return rows


def _speed_table(rep: Report) -> list[str]:
    model, s = rep.model, rep.settings
    crc_note = (
        " (under ~2 GB/s: the checksum is a bottleneck)" if rep.crc32_gbs < CRC_WARN_GBS else ""
    )
    rows = [
        f"Random KV of {s['speed_tokens']} tokens x {model['layers']} layers x K,V "
        f"({model['kv_heads']} heads, head_dim {model['head_dim']}, {model['dtype']}); GB/s of "
        f"uncompressed KV, median of {s['repeats']} runs.",
        "",
        "| codec | encoded/raw | encode GB/s | decode GB/s | frame encode+decode GB/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rep.speed:
        rows.append(
            f"| {r.codec} | {r.ratio:.3f} | {r.encode_gbs:.2f} | {r.decode_gbs:.2f} | "
            f"{r.frame_gbs:.2f} |"
        )
    rows += [
        "",
        "`none` encode of a contiguous CPU tensor is a zero-copy view: its rate is call overhead. "
        "Frame encode+decode = `encode_frame` (CRC-32 included) + the receiver joining the parts "
        "+ `decode_frame` (CRC-32 again) + `layers()`.",
        "",
        f"zlib.crc32 on {s['crc_mb']} MB: {rep.crc32_gbs:.2f} GB/s{crc_note}.",
    ]
    return rows


def _method_notes(rep: Report) -> list[str]:
    return [
        "Method: baseline keeps the KV in the cache; each codec run round-trips every prompt's "
        "KV through `encode_frame` / `decode_frame` right after its prefill step and decodes "
        "on. Token match: free-running greedy tokens vs the baseline, position-wise (token 0 "
        "precedes the transfer). KL: KL(p_baseline || p_codec) of the full next-token "
        "distribution, teacher-forced on the baseline's tokens so only the KV differs. "
        "Details: `pdserve.bench.micro.codec_bench`.",
    ]


def report_json(rep: Report) -> dict[str, Any]:
    data = asdict(rep)
    for q, raw in zip(rep.quality, data["quality"], strict=True):
        raw["bytes_per_token"] = q.bytes_per_token
    return data


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

    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    machine = machine_info(args.threads or torch.get_num_threads())
    texts = bench_prompts(args.num_prompts)
    tokenizer = loader.load_tokenizer(loader.resolve_model(args.model))
    prompts = [list(tokenizer.encode(t, add_special_tokens=True)) for t in texts]
    engine = build_engine(args, [len(p) for p in prompts])
    quality = measure_quality(engine, prompts, args.max_tokens, args.codecs)
    _log("speed")
    speed = measure_speed(engine, args.speed_tokens, args.codecs, args.repeats)
    crc32_gbs = common.measure_crc32(args.crc_mb, args.repeats)
    machine["load_average_end"] = list(os.getloadavg())
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
    common.write(render_markdown(rep), report_json(rep), args)
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
