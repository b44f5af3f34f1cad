"""Oracle tests: pdserve's model and engine against HF transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from factories import assert_engine_idle
from pdserve import LLM, SamplingParams
from pdserve.engine.scheduler import SchedulerOutput

PROMPT_LENS = [5, 17, 33, 1, 60, 9, 24, 40, 3, 12]


def _prompts(lens: list[int], seed: int = 7, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(3, 49152, (n,), generator=g).tolist() for n in lens]


def _hf(path) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    out = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        out.append(ids[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tiny_llama_path, tiny_qwen2_path):  # type: ignore[no-untyped-def]
    path = tiny_llama_path if request.param == "llama" else tiny_qwen2_path
    model = _hf(path)
    prompts = _prompts(PROMPT_LENS)
    return path, model, prompts, _hf_greedy(model, prompts, 32)


def _all_rows_logits(llm: LLM, out: SchedulerOutput) -> dict[str, torch.Tensor]:
    """Run one scheduled step, asking for logits at every row (not only sampled ones)."""
    runner = llm.engine.runner
    decodes = [s for s in out.scheduled if s.num_tokens == 1]
    chunks = [s for s in out.scheduled if s.num_tokens > 1]
    input_ids, meta = runner._prepare(decodes, chunks)
    meta.sample_rows = torch.arange(len(input_ids))
    logits = runner.model(input_ids, meta, runner.cache.layers)
    rows, row = {}, 0
    for s in decodes + chunks:  # the runner's row order
        rows[s.request_id] = logits[row : row + s.num_tokens]
        row += s.num_tokens
    return rows


def test_logits_match_hf_for_mixed_batch(tiny) -> None:  # type: ignore[no-untyped-def]
    """Prefill of a mixed-length batch, then one batched decode step: logits within 1e-4."""
    path, ref, prompts, _ = tiny
    llm = LLM(str(path), block_size=4, num_blocks=256)
    eng = llm.engine
    ids = [eng.add_request(p, SamplingParams(max_tokens=2, temperature=0)) for p in prompts[:6]]
    out = eng.scheduler.schedule()
    assert [s.num_tokens for s in out.scheduled] == [len(p) for p in prompts[:6]]
    with torch.no_grad():
        logits = _all_rows_logits(llm, out)
    next_tokens = {}
    for s, p in zip(out.scheduled, prompts[:6], strict=True):
        want = ref(torch.tensor([p])).logits[0]
        assert (logits[s.request_id] - want).abs().max().item() <= 1e-4
        next_tokens[s.request_id] = int(want[-1].argmax())
    eng.scheduler.update_from_output(out, next_tokens)
    out2 = eng.scheduler.schedule()
    assert all(s.num_tokens == 1 for s in out2.scheduled)
    logits2 = _all_rows_logits(llm, out2)
    for s, p in zip(out2.scheduled, prompts[:6], strict=True):
        want = ref(torch.tensor([[*p, next_tokens[s.request_id]]])).logits[0, -1]
        assert (logits2[s.request_id][0] - want).abs().max().item() <= 1e-4
    for rid in ids:
        eng.abort_request(rid)
    assert_engine_idle(llm)


GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.mark.parametrize(
    ("name", "engine_args"),
    [
        ("large-chunks", dict(max_num_batched_tokens=2048, enable_prefix_caching=False)),
        ("small-chunks", dict(max_num_batched_tokens=7, enable_prefix_caching=False)),
        ("prefix-cache", dict(max_num_batched_tokens=64, enable_prefix_caching=True)),
        ("prefill-first", dict(max_num_batched_tokens=50, decode_first=False)),
    ],
)
def test_greedy_matches_hf_generate(tiny, name, engine_args) -> None:  # type: ignore[no-untyped-def]
    path, _, prompts, want = tiny
    llm = LLM(str(path), block_size=4, num_blocks=512, **engine_args)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == want
    if engine_args.get("enable_prefix_caching", True):
        # Again: now every full prompt block is cached, and the output must not change.
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert again == want
        assert llm.engine.kv_manager.stats.hits > 0
    assert_engine_idle(llm)


def test_greedy_matches_hf_with_shared_prefixes(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    ref = _hf(tiny_llama_path)
    shared = _prompts([37], seed=3)[0]
    prompts = _prompts([1, 6, 13, 20], seed=11, prefix=shared)
    want = _hf_greedy(ref, prompts, 16)
    llm = LLM(str(tiny_llama_path), block_size=4, num_blocks=512, max_num_batched_tokens=48)
    first = llm.generate(prompts[:1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    rest = llm.generate(prompts[1:], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in first + rest] == want
    assert all(o.metrics.num_cached_tokens == 36 for o in rest)  # 9 full blocks of the prefix
    assert_engine_idle(llm)


def test_greedy_matches_hf_under_preemption(tiny) -> None:  # type: ignore[no-untyped-def]
    path, _, prompts, want = tiny
    # 40 blocks of 4 tokens cannot hold ten requests of up to 92 tokens at once.
    llm = LLM(str(path), block_size=4, num_blocks=40, max_num_batched_tokens=64)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == want
    assert_engine_idle(llm)


def test_text_prompts_and_batch_order(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_llama_path))
    texts = ["Hello there", "The quick brown fox jumps over", "a"]
    outs = llm.generate(texts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    single = [
        llm.generate(t, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
        for t in texts
    ]
    assert [o.prompt for o in outs] == texts
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in single]
    assert all(len(o.outputs[0].token_ids) == 5 and o.finished for o in outs)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_engine_idle(llm)
