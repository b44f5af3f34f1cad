"""`pdserve bench engine` end to end on a tiny random Llama with tiny sizes, plus its formulas.

No timing assertions: only that every field is there and every measured number is positive.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest

from pdserve import cli
from pdserve.bench.micro import engine_bench as eb
from pdserve.bench.micro.engine_report import evaluate_targets, render_markdown, report_json
from pdserve.bench.micro.engine_results import ModelCost, Report, Roofline, Row
from pdserve.engine.models.arch import ModelArch

TINY_ARGS = [
    "--threads", "1", "--prompt-lens", "8,16", "--batch-sizes", "1,2", "--decode-steps", "2",
    "--contexts", "16,40", "--repeats", "1", "--quantization", "none,int8",
]  # fmt: skip


@pytest.fixture(scope="module")
def bench_run(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    md, js = out / "engine.md", out / "engine.json"
    argv = ["bench", "engine", "--model", str(tiny_llama_path), *TINY_ARGS]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli.main([*argv, "--output", str(md), "--json", str(js)])
    return {"rc": rc, "stdout": stdout.getvalue(), "md": md.read_text(),
            "json": json.loads(js.read_text())}  # fmt: skip


def test_exits_zero_and_prints_the_report(bench_run: dict[str, Any]) -> None:
    assert bench_run["rc"] == 0
    assert bench_run["stdout"].strip() == bench_run["md"].strip()


def test_json_has_machine_roofline_and_model(bench_run: dict[str, Any]) -> None:
    data = bench_run["json"]
    machine = data["machine"]
    assert machine["threads"] == 1 and machine["cores"] >= 1
    assert machine["cpu"] and machine["torch"] and machine["transformers"]
    roof = data["roofline"]
    assert all(math.isfinite(v) and v > 0 for v in roof.values())
    assert roof["read_gbs"] == max(roof["sum_gbs"], roof["matvec_gbs"])
    weights = data["model"]["weight_bytes_per_step"]
    assert data["model"]["layers"] == 2 and 0 < weights["int8"] < 0.3 * weights["none"]
    assert data["date"] and "bench engine" in data["command"]
    assert data["settings"]["prompt_lens"] == [8, 16]
    assert data["notes"][0].startswith("llama.cpp: not run")  # an HF folder, not a GGUF


def test_json_rows_are_positive_with_hf_side_by_side(bench_run: dict[str, Any]) -> None:
    rows = bench_run["json"]["rows"]
    labels = ["prefill 8", "prefill 16", "decode B=1 C=16", "decode B=2 C=16",
              "decode B=1 C=40", "decode B=2 C=40"]  # fmt: skip
    assert [r["label"] for r in rows] == labels * 2
    assert [r["quantization"] for r in rows] == ["none"] * 6 + ["int8"] * 6
    for r in rows:
        for key in ("seconds", "tokens_per_s", "utilization", "context", "hf_seconds",
                    "hf_tokens_per_s", "ratio"):  # fmt: skip
            assert r[key] > 0, (r["label"], key)
        assert len(r["samples_s"]) == 1 and r["cpp_seconds"] is None
    decode = [r for r in rows if r["phase"] == "decode"]
    for r in decode:
        # C tokens of KV, 1 warm-up step, 2 timed steps: keys attended C+2 and C+3.
        assert r["context"] == r["nominal_context"] + 2.5
        assert r["tokens_per_s"] == pytest.approx(r["size"] / r["seconds"])
        assert 0 < r["attention_share"] < 1
    # transformers is measured once per point and shown beside every quantization
    assert rows[2]["hf_seconds"] == rows[8]["hf_seconds"]


def test_targets_report_met_missed_or_not_run(bench_run: dict[str, Any]) -> None:
    targets = {t["name"]: t["status"] for t in bench_run["json"]["targets"]}
    assert len(targets) == 16  # 8 per quantization
    assert targets["[int8] never slower than transformers (every pdserve/HF >= 1)"] in (
        "met", "missed",
    )  # fmt: skip
    # Neither prompt length 512, context 1024 nor llama.cpp was run.
    assert targets["[none] prefill MFU at 512 tokens >= 50%"] == "n/a"
    assert targets["[none] decode B=1 C=1024 faster per token than llama.cpp"] == "n/a"


def test_markdown_has_table_machine_and_targets(bench_run: dict[str, Any]) -> None:
    md = bench_run["md"]
    for text in ("| prefill 8 | none |", "| prefill 16 | int8 |", "| decode B=2 C=40 | int8 |",
                 "pdserve tok/s", "HF tok/s", "llama.cpp tok/s", "pdserve/HF", "GFLOP/s",
                 "GB/s", "threads used", "## Targets", "command: `pdserve bench engine",
                 "- date: ", "llama.cpp: not run"):  # fmt: skip
        assert text in md, text


def _tiny_arch(tied: bool) -> ModelArch:
    return ModelArch(
        architecture="llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
        num_heads=2, num_kv_heads=1, head_dim=4, tie_word_embeddings=tied,
    )  # fmt: skip


@pytest.mark.parametrize("tied", [True, False])
def test_model_cost_formulas(tied: bool) -> None:
    cost = ModelCost.from_arch(_tiny_arch(tied), elem_size=4)
    # Per layer: q 8x8, k 4x8, v 4x8, o 8x8, gate/up 16x8 each, down 8x16.
    per_layer = 64 + 32 + 32 + 64 + 3 * 128
    assert cost.matmul_params == 2 * per_layer
    body = 2 * (per_layer + 2 * 8) + 8  # plus two norms per layer and the final norm
    assert cost.weight_bytes() == (body + 100 * 8) * 4  # the head is read once, tied or not
    n = 10
    attention = 4 * 2 * 2 * 4 * n * n / 2
    assert cost.prefill_flops(n) == 2 * cost.matmul_params * n + attention + 2 * 100 * 8
    assert cost.kv_bytes(3, 5.5) == 3 * 5.5 * 2 * 2 * 1 * 4 * 4


def _decode(b: int, c: int, s: float, **kw: Any) -> Row:
    return Row("decode", b, s, b / s, 0.5, c + 1.0, kw.pop("samples", []), "none", c, **kw)


def test_report_without_peers_renders_dashes_and_na() -> None:
    rows = [
        Row("prefill", 512, 0.5, 1024.0, 0.6, 512.0, cpp_tokens_per_s=500.0),
        _decode(1, 128, 0.01),
        _decode(1, 1024, 0.012, cpp_tokens_per_s=90.0, attention_share=0.25, kv_read_s=0.001),
        _decode(1, 2048, 0.014),
        _decode(8, 128, 0.02, samples=[0.02, 0.03]),
    ]
    rows[2].utilization = 1.2
    status = {t.name: t.status for t in evaluate_targets(rows)}
    assert status == {
        "[none] prefill MFU at 512 tokens >= 50%": "met",
        "[none] decode B=1 C=1024 MBU >= 70%": "met",
        "[none] decode B=1 C=1024 faster per token than llama.cpp": "missed",  # 83 vs 90 tok/s
        "[none] prefill tokens/s >= 1.5x llama.cpp (every length)": "met",
        "[none] decode B=8 tokens/s >= 5x B=1 (C=128)": "missed",
        "[none] decode B=1 step at C=2048 <= 1.3x the step at C=128": "missed",
        # 0.25 x 12 ms inside attention against 1 ms to read the KV: 3x
        "[none] attention at B=1 C=1024 <= 2x the time to read its KV": "missed",
        "[none] never slower than transformers (every pdserve/HF >= 1)": "n/a",
    }
    rep = Report("2025-01-01T00:00:00+00:00", "pdserve bench engine --no-hf",
                    {"cpu": "x", "cores": 2, "threads": 1, "torch": "t", "transformers": "h",
                     "load_average": [0.0, 0.0, 0.0]},
                    {"name": "m", "source": "hf", "dtype": "float32", "layers": 2,
                     "matmul_params": 10, "weight_bytes_per_step": {"none": 40}},
                    {"decode_steps": 32, "repeats": 3},
                    Roofline(100.0, 10.0, 9.0, 10.0, 20.0), rows, [],
                    ["llama.cpp: x"])  # fmt: skip
    md = render_markdown(rep)
    assert "| decode B=8 C=128 | none | 400.0 | 20.0 | — | — | — | — | MBU 50.0% | — |" in md
    assert "Noisy (slowest/fastest repeat > 1.3x): none decode B=8 C=128 (1.5x)." in md
    assert "Above 100% of the roofline: none decode B=1 C=1024;" in md
    assert "- llama.cpp: x" in md
    assert json.loads(json.dumps(report_json(rep)))["rows"][1]["ratio"] is None


def test_flags_and_defaults() -> None:
    parser = argparse.ArgumentParser()
    eb.add_arguments(parser)
    args = parser.parse_args([])
    assert args.model is None and args.threads is None and not args.no_hf
    assert args.prompt_lens == [128, 512, 2048] and args.batch_sizes == [1, 8, 32]
    assert args.contexts == [128, 1024, 2048] and args.quantization == ["none", "int8"]
    assert (args.decode_steps, args.repeats) == (16, 3)
    assert parser.parse_args(["--batch-sizes", "2,4"]).batch_sizes == [2, 4]
    for bad in ("0", "a,b", ""):
        with pytest.raises(SystemExit):
            parser.parse_args(["--prompt-lens", bad])
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])


def test_decode_matmuls_vary_for_float32_weights_only() -> None:
    parser = argparse.ArgumentParser()
    eb.add_arguments(parser)
    args = parser.parse_args(["--quantization", "none,w8g32", "--decode-matmuls", "auto,torch"])
    assert eb.variants(args) == [
        ("none", "auto", "auto", "auto"),
        ("none", "auto", "torch", "auto"),
        ("w8g32", "auto", "auto", "auto"),
    ]
    assert [eb.variant_label(*v) for v in eb.variants(args)] == ["none", "none mm=torch", "w8g32"]
    assert eb.variant_label("none", "float16", "torch") == "none kv=float16 mm=torch"
    with pytest.raises(SystemExit):
        parser.parse_args(["--decode-matmuls", "mkl"])


def test_prefill_formats_are_measured_side_by_side() -> None:
    parser = argparse.ArgumentParser()
    eb.add_arguments(parser)
    args = parser.parse_args(["--quantization", "gguf-a16", "--prefill-formats", "none,bf16"])
    assert eb.variants(args) == [
        ("gguf-a16", "auto", "auto", "none"),
        ("gguf-a16", "auto", "auto", "bf16"),
    ]
    labels = [eb.variant_label(*v) for v in eb.variants(args)]
    assert labels == ["gguf-a16 prefill=none", "gguf-a16 prefill=bf16"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill-formats", "fp8"])


def test_attention_target_is_attention_time_over_kv_read_time() -> None:
    row = _decode(1, 1024, 0.020, attention_share=0.1, kv_read_s=0.0015)  # 2 ms vs 1.5 ms
    status = {t.name: (t.measured, t.status) for t in evaluate_targets([row])}
    assert status["[none] attention at B=1 C=1024 <= 2x the time to read its KV"] == (
        "1.33x",
        "met",
    )
    row.attention_share = None  # --no-attention
    status = {t.name: t.status for t in evaluate_targets([row])}
    assert status["[none] attention at B=1 C=1024 <= 2x the time to read its KV"] == "n/a"


class _FakeSystem:
    """A side of the rounds that records its calls and returns the call's number (seconds)."""

    def __init__(self, name: str, keys: list[Any], calls: list[tuple[str, Any]]) -> None:
        self.name, self.keys, self._calls = name, keys, calls

    def once(self, key: Any) -> float:
        self._calls.append((self.name, key))
        return float(len(self._calls))


def test_rounds_run_each_point_on_every_side_in_turn() -> None:
    from pdserve.bench.micro.engine_results import DecodePoint

    p, d1, d8 = (
        ("prefill", 16),
        ("decode", DecodePoint(1, 128, 4)),
        ("decode", DecodePoint(8, 128, 4)),
    )
    calls: list[tuple[str, Any]] = []
    a = _FakeSystem("a", [p, d1, d8], calls)
    b = _FakeSystem("b", [p, d1], calls)
    got = eb.run_rounds([a, b], 2)
    # Each point on a then b in the warm-up round and round 2, b then a in round 1; b has no d8.
    warm = [("a", p), ("b", p), ("a", d1), ("b", d1), ("a", d8)]
    reverse = [("b", p), ("a", p), ("b", d1), ("a", d1), ("a", d8)]
    assert calls == warm + reverse + warm
    assert got["a"] == {p: [7.0, 11.0], d1: [9.0, 13.0], d8: [10.0, 15.0]}  # warm-up dropped
    assert got["b"] == {p: [6.0, 12.0], d1: [8.0, 14.0]}


def test_peer_ratios_pair_the_samples_of_each_round() -> None:
    # pdserve ran 2x faster than the peer in two rounds of three while the machine drifted:
    # the median of the rounds' ratios says 2x, the ratio of the medians would say 1x.
    row = _decode(1, 1024, 2.0, samples=[1.0, 3.0, 2.0])
    row.hf_samples_s, row.hf_tokens_per_s = [2.0, 6.0, 1.0], 0.5
    row.cpp_samples_s, row.cpp_tokens_per_s = [4.0], 0.25  # not from the same rounds
    assert row.ratio == pytest.approx(2.0)
    assert row.cpp_ratio == pytest.approx((1 / 2.0) / 0.25)  # the medians' speeds
    row.hf_samples_s, row.hf_tokens_per_s = [], None
    assert row.ratio is None
