"""`--kv-cache-dtype`: a float16 / bfloat16 KV cache under a float32 model (half the bytes per
token), its errors, and what it changes (capacity, stats) and does not (hand-offs, leaks)."""

from __future__ import annotations

import pytest
import torch

from factories import assert_engine_idle, greedy_agreement
from pdserve import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(3, 49000, (int(s),), generator=g).tolist() for s in (5, 9, 23, 40, 61, 90)[:n]
    ]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_narrow_cache_decodes_like_float32(tiny_llama_path, kv: str) -> None:  # type: ignore[no-untyped-def]
    """The cache is read only from the second token on (a fresh prompt attends to its own
    float32 K/V): first tokens are identical, later ones stay close (greedy agreement)."""
    prompts = _prompts()
    ref = _tokens(LLM(str(tiny_llama_path), block_size=8, num_blocks=128), prompts)
    llm = LLM(str(tiny_llama_path), block_size=8, num_blocks=128, kv_cache_dtype=kv)
    assert llm.engine.cache.dtype == getattr(torch, kv)
    got = _tokens(llm, prompts)
    assert [t[0] for t in got] == [t[0] for t in ref]
    shares = [greedy_agreement([b], [a]) for a, b in zip(got, ref, strict=True)]
    assert sum(shares) / len(shares) >= (0.8 if kv == "float16" else 0.5), shares
    assert llm.engine.stats()["kv_cache_dtype"] == kv
    assert_engine_idle(llm)


def test_gather_and_paged_attention_agree_on_a_float16_cache(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    """The reference path (--attention gather: widen the gathered blocks, SDPA) and the kernel
    read the same float16 cache: same greedy tokens."""
    prompts = _prompts(4)
    common = {"block_size": 8, "num_blocks": 128, "kv_cache_dtype": "float16"}
    paged = _tokens(LLM(str(tiny_llama_path), attention="paged", **common), prompts)
    gather = _tokens(LLM(str(tiny_llama_path), attention="gather", **common), prompts)
    assert paged == gather


def test_half_the_bytes_twice_the_blocks(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    full = LLM(str(tiny_llama_path), kv_cache_memory_gb=0.01)
    half = LLM(str(tiny_llama_path), kv_cache_memory_gb=0.01, kv_cache_dtype="float16")
    assert half.engine.cache.num_blocks in (
        2 * full.engine.cache.num_blocks,
        2 * full.engine.cache.num_blocks + 1,
    )
    assert (
        half.engine.cache.nbytes
        <= full.engine.cache.nbytes + half.engine.cache.nbytes // half.engine.cache.num_blocks
    )


def test_bad_kv_cache_dtypes_are_clear_errors(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(str(tiny_llama_path), kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="needs --dtype float32"):
        LLM(str(tiny_llama_path), dtype="bfloat16", kv_cache_dtype="float16")


def test_handoff_from_a_float16_cache(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    """P and D with float16 caches hand over exactly what one float16 engine computes (the wire
    carries float32: read_kv widens, write_kv rounds back to the same values); P float16 to a
    float32 D completes too, leaking nothing."""
    from factories import handoff

    path = str(tiny_llama_path)
    kw = {"block_size": 8, "num_blocks": 128, "kv_cache_dtype": "float16"}
    ref, p, d = LLM(path, **kw), LLM(path, **kw), LLM(path, **kw)
    d32 = LLM(path, block_size=8, num_blocks=128)
    for prompt in _prompts(3):
        want = ref.generate([prompt], PARAMS)[0].outputs[0].token_ids
        assert handoff(p, d, prompt, PARAMS, 2) == want
        assert len(handoff(p, d32, prompt, PARAMS, 1)) == PARAMS.max_tokens
    for llm in (ref, p, d, d32):
        assert_engine_idle(llm)


def test_cost_model_file_is_per_kv_cache_dtype(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from pdserve.costmodel.model import default_path
    from pdserve.costmodel.profile import _load_valid

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert default_path("/m/x.gguf", 1, host="h").name == "h-x-t1.json"
    named = default_path("/m/x.gguf", 1, host="h", quantization="w8g32", kv_cache_dtype="float16")
    assert named.name == "h-x-w8g32-kv-float16-t1.json"
    from pdserve.costmodel.model import CostModel

    path = tmp_path / "c.json"
    CostModel((0.01, 1e-4, 0.0), (0.005, 1e-3, 1e-6)).save(
        path, threads=1, quantization="none", kv_cache_dtype="auto"
    )
    assert _load_valid(path, 1) is not None
    assert _load_valid(path, 1, kv_cache_dtype="float16") is None  # measured on another cache


@pytest.mark.parametrize(
    ("kv", "quantization", "dtype", "want"),
    [
        ("auto", "none", "float32", "float32"),
        ("auto", "w8g32", "float32", "float16"),
        ("auto", "w8a8", "float32", "float32"),
        ("auto", "int8", "float32", "float32"),
        ("auto", "none", "bfloat16", "bfloat16"),
        ("float32", "w8g32", "float32", "float32"),
        ("float16", "w8a8", "float32", "float16"),
        ("bfloat16", "w8g32", "float32", "bfloat16"),
    ],
)
def test_auto_is_float16_under_w8g32(kv, quantization, dtype, want) -> None:  # type: ignore[no-untyped-def]
    """`auto` keeps the model's dtype (exact HF parity for `none`; w8a8, whose agreement a
    float16 cache measurably lowers), float16 under w8g32; an explicit dtype is always taken.
    The cost model's name follows the cache actually allocated, not the flag's spelling."""
    from pdserve.config import cost_kv_cache_dtype, resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype(kv, quantization, dtype) == want
    assert cost_kv_cache_dtype(kv, quantization, dtype) == ("auto" if want == dtype else want)


def test_quantized_engine_allocates_a_float16_cache_by_default(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    """What the engine allocates and reports (/admin/workers reads stats()) for `auto` under
    w8g32, and for an explicit float32 there."""
    kw = {"block_size": 8, "num_blocks": 64, "quantization": "w8g32"}
    auto = LLM(str(tiny_llama_path), **kw)
    assert auto.engine.cache.dtype == torch.float16
    assert auto.engine.stats()["kv_cache_dtype"] == "float16"
    full = LLM(str(tiny_llama_path), kv_cache_dtype="float32", **kw)
    assert full.engine.cache.dtype == torch.float32
    plain = LLM(str(tiny_llama_path), block_size=8, num_blocks=64)
    assert plain.engine.cache.dtype == torch.float32
    assert len(_tokens(auto, _prompts(2))[0]) == PARAMS.max_tokens
    assert_engine_idle(auto)


def test_serve_names_the_cost_model_after_the_allocated_cache(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`pdserve serve --quantization w8g32` (auto KV) loads the file that `bench profile
    --quantization w8g32 --kv-cache-dtype float16` writes: one measurement, one name."""
    from factories import share_model_conversions
    from pdserve.deployment import Deployment
    from pdserve.serve import plan

    # its own cost models; the default model's GGUF index as converted once (~4-9 s to parse)
    share_model_conversions(tmp_path)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))

    def name(**kw: str) -> str:
        return plan.cost_path(Deployment(engine=kw), 1).name

    assert "-w8g32-kv-float16-" in name(quantization="w8g32")
    assert name(quantization="w8g32") == name(quantization="w8g32", kv_cache_dtype="float16")
    assert "-kv-" not in name(quantization="w8g32", kv_cache_dtype="float32")
    assert "-kv-" not in name(quantization="w8a8")
    assert "-kv-" not in name(quantization="none")
    # The default (`auto`) is named after what the workers run on the default model: the Q4_1
    # file's own weights on int16 activations, float16 KV; the same file `bench profile
    # --quantization gguf-a16` writes.
    assert name() == name(quantization="gguf-a16") and "-gguf-a16-kv-float16-" in name()
    from pdserve.engine import prefill_format

    amx = prefill_format.MatrixUnits(amx_bf16=True, avx512_bf16=True)
    monkeypatch.setattr(prefill_format, "probe_units", lambda: amx)  # what auto resolves to
    assert "-pf-bf16x3-" in name(quantization="gguf-a16", prefill_format="bf16x3")
    assert name(quantization="gguf-a16") == name(quantization="gguf-a16", prefill_format="bf16x3")
    assert "-pf-" not in name(quantization="gguf-a16", prefill_format="none")
