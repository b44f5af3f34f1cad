"""The prefill format (engine/prefill_format.py): prompt rows on bfloat16 copies of the weights,
decode rows on the decode format; chosen per CPU, held per role, checked for agreement."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine import kernels, prefill_format
from pdserve.engine.linear import bf16
from pdserve.engine.linear.bf16 import BF16Linear
from pdserve.engine.linear.phases import MIN_PROMPT_ROWS, StepRows
from pdserve.engine.prefill_format import MatrixUnits, PhaseProjection
from pdserve.engine.quantize import projection_bytes

AMX = MatrixUnits(amx_bf16=True, avx512_bf16=True)
ZEN4 = MatrixUnits(amx_bf16=False, avx512_bf16=True)
AVX2 = MatrixUnits(amx_bf16=False, avx512_bf16=False)
CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _prompt(n: int, seed: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


# ---- the choice: a fake CPU-capability probe ---------------------------------------------------
def test_units_from_cpu_flags() -> None:
    flags = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    assert MatrixUnits.from_flags(flags).isa == "amx"
    assert MatrixUnits.from_flags(frozenset({"avx512_bf16"})).isa == "avx512_bf16"
    assert MatrixUnits.from_flags(frozenset({"avx2", "fma"})).isa == "none"


@pytest.mark.parametrize(
    ("name", "phases", "quantization", "units", "outcome"),
    [
        ("auto", "both", "gguf-a16", AMX, "bf16x3"),
        ("auto", "prefill", "gguf-a16", AMX, "bf16x3"),
        ("auto", "both", "gguf-a16", ZEN4, "none"),  # bf16 alone agrees less: only when asked
        ("auto", "both", "gguf-a16", AVX2, "none"),  # no bf16 instructions: today's path
        ("auto", "both", "none", AMX, "none"),  # exact float32 stays exact unless asked
        ("auto", "decode", "gguf-a16", AMX, "none"),  # a D worker holds the decode format only
        ("bf16", "both", "none", AVX2, "bf16"),  # asked for: made anywhere (emulated here)
        ("bf16x3", "prefill", "w8g32", AMX, "bf16x3"),
        ("none", "both", "gguf-a16", AMX, "none"),
    ],
)
def test_what_is_wanted(name, phases, quantization, units, outcome) -> None:  # type: ignore[no-untyped-def]
    kind, why = prefill_format.wanted(name, phases, quantization, CPU, torch.float32, units)
    assert kind == outcome and why


def test_what_cannot_be_built_is_refused() -> None:
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        prefill_format.wanted("bf16", "both", "none", CPU, torch.bfloat16, AMX)
    with pytest.raises(ValueError, match="AMX tiles, which this CPU lacks"):
        prefill_format.wanted("bf16x3", "both", "gguf-a16", CPU, torch.float32, ZEN4)
    with pytest.raises(ValueError, match="multiples of 32"):
        prefill_format.wanted("bf16x3", "both", "none", CPU, torch.float32, AMX, (576, 1000))
    odd = prefill_format.wanted("auto", "both", "gguf-a16", CPU, torch.float32, AMX, (100,))
    assert odd[0] == "none" and "multiples of 32" in odd[1]


def _attach(path, name: str, timing: tuple[float, float]):  # type: ignore[no-untyped-def]
    """A float32 engine's model given bf16 copies through `attach` under a fake probe."""
    llm = LLM(str(path), prefill_format="none")
    model = llm.engine.model
    copies = prefill_format.make_copies(model, "bf16")
    choice = prefill_format.attach(model, copies, name, "both", AMX, lambda *a: timing)
    return llm, choice


def test_auto_keeps_the_decode_format_when_the_probe_says_it_loses(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    llm, choice = _attach(tiny_llama_path, "auto", (10.0, 11.0))  # the copies slower
    assert choice.format == "none" and "0.91x" in choice.reason
    assert llm.engine.model.step_rows is None


def test_auto_takes_the_copies_when_the_probe_says_they_win(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    llm, choice = _attach(tiny_llama_path, "auto", (12.0, 3.0))
    assert (choice.format, choice.isa) == ("bf16", "amx") and "4.00x" in choice.reason
    assert choice.extra_bytes > 0
    llm.engine.prefill_choice = choice
    llm.generate([_prompt(40)], GREEDY)
    stats = llm.engine.stats()
    assert stats["prefill_format"] == "bf16" and stats["prompt_rows_prefill_format"] == 40
    assert stats["prefill_probe_speedup"] == 4.0


def test_the_copies_are_not_counted_as_bytes_a_decode_step_reads(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    plain = LLM(str(tiny_llama_path), prefill_format="none")
    llm, choice = _attach(tiny_llama_path, "auto", (12.0, 3.0))
    assert choice.format == "bf16" and choice.extra_bytes > 0
    assert projection_bytes(llm.engine.model) == projection_bytes(plain.engine.model)


# ---- the row split -------------------------------------------------------------------------------
class _Scale:
    def __init__(self, k: float) -> None:
        self.k, self.calls = k, 0

    def __call__(self, x, residual=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        y = x * self.k
        return y if residual is None else y + residual


def test_a_step_splits_its_rows_between_the_formats() -> None:
    rows = StepRows(has_decode_format=True)
    decode = _Scale(1.0)
    prefill = BF16Linear(torch.eye(8) * 2)
    proj = PhaseProjection(decode, prefill, rows)
    x, res = torch.randn(3 + MIN_PROMPT_ROWS, 8), torch.randn(3 + MIN_PROMPT_ROWS, 8)
    assert rows.set(len(x), num_decodes=3)  # 3 decodes, then prompt rows
    y = proj(x, res)
    torch.testing.assert_close(y[:3], x[:3] + res[:3])
    want = res[3:] + (x[3:].bfloat16().float() * 2).bfloat16().float()
    torch.testing.assert_close(y[3:], want)
    # few prompt rows: the whole step on the decode format (one call)
    assert not rows.set(3 + MIN_PROMPT_ROWS - 1, num_decodes=3)
    decode.calls = 0
    torch.testing.assert_close(proj(x[:-1]), x[:-1])
    assert decode.calls == 1
    assert rows.prompt_rows_run == MIN_PROMPT_ROWS
    assert rows.prompt_rows_decode_format == MIN_PROMPT_ROWS - 1


def test_without_a_decode_format_every_row_runs_bf16() -> None:
    rows = StepRows(has_decode_format=False)
    proj = PhaseProjection(None, BF16Linear(torch.eye(4)), rows)
    assert rows.set(5, num_decodes=5) and rows.first_prompt_row == 0
    x = torch.randn(5, 4)
    torch.testing.assert_close(proj(x), x.bfloat16().float())


def test_native_ops_match_torch_in_bf16() -> None:
    ops = kernels.load("bf16")
    x = torch.randn(37, 2 * 21).bfloat16()  # 21: a tail past the vector width
    want = (torch.nn.functional.silu(x[:, :21].float()) * x[:, 21:].float()).bfloat16()
    assert (ops.silu_mul(x, 21).float() - want.float()).abs().max() <= 0.008
    y, b, r = torch.randn(9, 13).bfloat16(), torch.randn(13), torch.randn(9, 13)
    torch.testing.assert_close(ops.widen_add(y, b, r), r + (y.float() + b), rtol=0, atol=0)
    torch.testing.assert_close(ops.widen_add(y), y.float(), rtol=0, atol=0)
    h, w = torch.randn(11, 19), torch.randn(19)
    ref = torch.nn.functional.rms_norm(h, (19,), w, 1e-5).bfloat16().float()
    got = ops.rms_norm(h, w, 1e-5).float()
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()


# ---- agreement -----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["tiny_llama_path", "tiny_qwen2_path"])
def test_bf16_prompts_agree_with_float32(path, request) -> None:  # type: ignore[no-untyped-def]
    """The first token's logits of a 200-token prompt: bf16 within a few bf16 roundings of
    float32 (Qwen2: q/k/v bias through the bf16 path), and the greedy tokens agree."""
    model = str(request.getfixturevalue(path))
    exact, fast = LLM(model), LLM(model, prefill_format="bf16")
    prompts = [_prompt(200, s) for s in range(4)]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    for a, b in zip(exact.generate(prompts, params), fast.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    ref = exact.generate(prompts, GREEDY)
    got = fast.generate(prompts, GREEDY)
    same = sum(
        r.outputs[0].token_ids == g.outputs[0].token_ids for r, g in zip(ref, got, strict=True)
    )
    assert same >= 3, (same, [g.outputs[0].token_ids for g in got])
    assert fast.engine.stats()["prompt_rows_prefill_format"] >= 800


def test_colocated_mixed_steps_keep_decodes_on_the_decode_format(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    """A prompt arriving while others decode: its rows run bf16, the decodes' rows the decode
    format, in one step; the decodes' tokens are those of an engine without the bf16 copies."""
    plain = LLM(str(tiny_llama_path))
    both = LLM(str(tiny_llama_path), prefill_format="bf16", max_num_batched_tokens=64)
    short = [_prompt(5, s) for s in range(3)]  # under MIN_PROMPT_ROWS: the decode format
    eng = both.engine
    ids = [eng.add_request(p, GREEDY) for p in short]
    eng.step()
    eng.step()
    late = eng.add_request(_prompt(100, 9), GREEDY)  # 100 rows in chunks beside 3 decodes
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    want = plain.generate(short, GREEDY)
    assert [done[i] for i in ids] == [o.outputs[0].token_ids for o in want]
    assert eng.stats()["prompt_rows_prefill_format"] >= 100 - MIN_PROMPT_ROWS
    assert late in done and len(done[late]) == GREEDY.max_tokens


# ---- bf16x3 on AMX tiles -------------------------------------------------------------------------
needs_amx = pytest.mark.skipif(
    not kernels.amx_supported(),
    reason="bf16x3 runs AMX tile instructions: this CPU has none (AVX2 only, or AMX hidden by "
    "the hypervisor)",
)


@needs_amx
@pytest.mark.parametrize("rows", [1, 17, 33, 512])
def test_amx_bf16x3_matmul_is_float32_close(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(96, 64, generator=g)
    b, r = torch.randn(64, generator=g), torch.randn(rows, 64, generator=g)
    lin = bf16.AMXLinear(w, b)
    want = r.double() + (x.double() @ w.double() + b.double())
    got = lin(x, r)
    assert (got.double() - want).abs().max() <= 2e-5 * want.abs().max()
    one = kernels.load("amx").matmul(x, lin.hi, 64)  # hi alone: one bfloat16 product
    err = (one.double() - x.double() @ w.double()).abs().max() / want.abs().max()
    assert 1e-4 < err < 1e-2  # bfloat16's rounding, which lo removes
    strided = torch.randn(rows, 200, generator=g)[:, :96]
    torch.testing.assert_close(lin(strided), lin(strided.contiguous()), rtol=0, atol=0)
    gate_up = bf16.AMXLinear(w)  # the MLP's activation in the GEMM's store
    y = x.double() @ w.double()
    act = torch.nn.functional.silu(y[:, :32]) * y[:, 32:]
    assert (gate_up.silu_mul(x).double() - act).abs().max() <= 1e-4 * act.abs().max()


@needs_amx
def test_bf16x3_prompts_agree_with_float32(tiny_qwen2_path) -> None:  # type: ignore[no-untyped-def]
    exact = LLM(str(tiny_qwen2_path))
    fast = LLM(str(tiny_qwen2_path), prefill_format="bf16x3")
    assert fast.engine.stats()["prefill_format"] == "bf16x3"
    prompts = [_prompt(200, s) for s in range(4)]
    ref = [o.outputs[0].token_ids for o in exact.generate(prompts, GREEDY)]
    assert [o.outputs[0].token_ids for o in fast.generate(prompts, GREEDY)] == ref
    assert fast.engine.stats()["prompt_rows_prefill_format"] == 800


@needs_amx
@pytest.mark.parametrize("t", [1, 15, 33, 300])
def test_amx_causal_attention_matches_float64(t: int) -> None:
    """Fresh prompts' attention under bf16x3: scores float32-close (three products), values
    and probabilities one bfloat16 rounding; GQA (9 query heads on 3 KV heads) and strided q/k
    views as the layer hands them over (RoPE's [T, H + KVH, D] output)."""
    g = torch.Generator().manual_seed(t)
    qk, v = torch.randn(t, 12, 64, generator=g) * 2, torch.randn(t, 3, 64, generator=g)
    q, k = qk[:, :9], qk[:, 9:]
    got = kernels.load("amx").causal_attention(q, k, v, 0.125)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(x.double().transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True
    )[0].transpose(0, 1)
    assert got.shape == (t, 9, 64) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 0.03  # v and p in bfloat16: ~2^-9 relative
    # a chunk of the last n queries behind a cached prefix: the same rows of the whole
    n = max(1, t // 3)
    tail = kernels.load("amx").causal_attention(q[-n:], k, v, 0.125)
    assert tail.shape == (n, 9, 64)
    assert (tail.double() - want[-n:]).abs().max() <= 0.03
    # one bfloat16 product for the scores (the bf16 format's): q and k rounded once each,
    # scores ~2^-8 relative off, further from float64 than bf16x3 but as close as torch's SDPA
    # on bfloat16 inputs
    one = kernels.load("amx").causal_attention(q, k, v, 0.125, split=False)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        *(x.bfloat16().transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True
    )[0].transpose(0, 1)
    err, err_sdpa = (one.double() - want).abs().max(), (sdpa.double() - want).abs().max()
    assert one.dtype == torch.float32 and err <= max(0.06, 1.5 * err_sdpa), (err, err_sdpa)
    if t >= 33:  # enough keys for the split to show: three products are closer
        assert (got.double() - want).abs().max() < err


@needs_amx
def test_bf16_prompts_attend_on_amx_tiles_with_one_product() -> None:
    """The bf16 format's fresh-prompt attention: the AMX kernel with one bfloat16 product for
    the scores where the CPU has AMX, torch's SDPA in bfloat16 where it has not."""
    one = prefill_format.prompt_attention("bf16", AMX)
    assert one is not None and one.keywords == {"split": False}  # type: ignore[attr-defined]
    assert prefill_format.prompt_attention("bf16", ZEN4) is None
    assert prefill_format.prompt_attention("bf16x3", AMX) is kernels.load("amx").causal_attention
