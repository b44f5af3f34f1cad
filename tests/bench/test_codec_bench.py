"""`pdserve bench codec` end to end on a tiny random Llama: 2 prompts x 4 tokens.

No quality or speed assertions beyond sanity: the "none" codec must reproduce the baseline
exactly (that checks the method), every field must be present and every speed positive.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.micro import codec_bench as cb
from pdserve.bench.micro.codec_quality import bench_prompts

TINY_ARGS = ["--num-prompts", "2", "--max-tokens", "4", "--threads", "1",
             "--speed-tokens", "32", "--crc-mb", "1", "--repeats", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def bench_run(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("codec-bench")
    md, js = out / "kv_codec.md", out / "kv_codec.json"
    argv = ["--model", str(tiny_llama_path), *TINY_ARGS, "--output", str(md), "--json", str(js)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cb.main(argv)
    return {"rc": rc, "stdout": stdout.getvalue(), "md": md.read_text(),
            "json": json.loads(js.read_text())}  # fmt: skip


def test_exits_zero_and_prints_the_report(bench_run: dict[str, Any]) -> None:
    assert bench_run["rc"] == 0
    assert bench_run["stdout"].strip() == bench_run["md"].strip()


def test_markdown_has_header_quality_and_speed(bench_run: dict[str, Any]) -> None:
    md = bench_run["md"]
    for needle in ("- date:", "- command: `pdserve bench codec", "- machine:", "cores",
                   "1 torch threads", "- model:", "- prompts: 2 (", "## Quality", "## Speed",
                   "token match", "mean KL", "saved vs none", "encode GB/s", "decode GB/s",
                   "zlib.crc32 on 1 MB"):  # fmt: skip
        assert needle in md, needle
    for codec in ("none", "int8", "int4"):
        assert f"| {codec} |" in md


def test_json_quality_none_reproduces_baseline_and_compression_saves(
    bench_run: dict[str, Any],
) -> None:
    data = bench_run["json"]
    assert data["settings"]["kl_steps"] == 3 and data["settings"]["max_tokens"] == 4
    assert len(data["prompt_lens"]) == 2 and all(30 <= n <= 200 for n in data["prompt_lens"])
    quality = {q["codec"]: q for q in data["quality"]}
    assert quality["none"]["token_match"] == 1.0 and quality["none"]["kl_mean"] == 0.0
    assert quality["none"]["identical_prompts"] == 2
    for q in quality.values():
        assert 0.0 <= q["token_match"] <= 1.0 and q["kl_mean"] >= 0.0 and q["kl_max"] >= 0.0
        assert q["prompt_tokens"] == sum(data["prompt_lens"])
    bpt = {c: q["bytes_per_token"] for c, q in quality.items()}
    assert bpt["none"] > bpt["int8"] > bpt["int4"] > 0


def test_json_speed_is_positive(bench_run: dict[str, Any]) -> None:
    data = bench_run["json"]
    assert data["crc32_gbs"] > 0 and data["machine"]["threads"] == 1
    for s in data["speed"]:
        assert s["encode_gbs"] > 0 and s["decode_gbs"] > 0 and s["frame_gbs"] > 0
    ratios = {s["codec"]: s["ratio"] for s in data["speed"]}
    assert ratios["none"] == 1.0 and ratios["int4"] < ratios["int8"] < 1.0


def test_all_prompts_are_30_to_200_tokens(default_tokenizer: Any) -> None:
    prompts = bench_prompts(60)
    assert len(set(prompts)) == 60
    lens = [len(default_tokenizer.encode(p)) for p in prompts]
    assert min(lens) >= 30 and max(lens) <= 200, (min(lens), max(lens))
    with pytest.raises(ValueError, match="at most 60"):
        bench_prompts(61)


def test_codecs_argument_is_validated() -> None:
    parser = argparse.ArgumentParser()
    cb.add_arguments(parser)
    assert parser.parse_args(["--codecs", "int8,none"]).codecs == ["int8", "none"]
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parser.parse_args(["--codecs", "zstd"])
