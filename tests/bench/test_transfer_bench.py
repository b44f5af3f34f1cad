"""`pdserve bench transfer` end to end on the tiny random Llama's KV layout with tiny sizes, the
TTFT part on a tiny 1P1D cluster, and the timeline arithmetic.

No timing assertions: only that every field is there and every measured number is sane.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.transfer import transfer_bench as tb
from pdserve.bench.transfer import transfer_report as tr
from pdserve.bench.transfer.transfer_results import BREAKDOWN

TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K,V x 2 layers x 2 KV heads x head_dim 16 x fp32


def _run(argv: list[str], out: Path) -> dict[str, Any]:
    md, js = out / "transfer.md", out / "transfer.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = tb.main([*argv, "--output", str(md), "--json", str(js)])
    return {"rc": rc, "stdout": stdout.getvalue(), "md": md.read_text(),
            "json": json.loads(js.read_text())}  # fmt: skip


@pytest.fixture(scope="module")
def throughput_run(
    tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    argv = [
        "--model", str(tiny_llama_path), "--sizes", "8,16", "--transports", "tcp,shm",
        "--codecs", "none,int8", "--repeats", "1", "--no-ttft",
    ]  # fmt: skip
    return _run(argv, tmp_path_factory.mktemp("transfer"))


@pytest.fixture(scope="module")
def ttft_run(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    argv = [
        "--model", str(tiny_llama_path), "--no-throughput", "--ttft-lens", "32",
        "--ttft-requests", "1", "--ttft-transports", "tcp",
    ]  # fmt: skip
    return _run(argv, tmp_path_factory.mktemp("transfer-ttft"))


def test_throughput_exits_zero_and_prints_the_report(throughput_run: dict[str, Any]) -> None:
    assert throughput_run["rc"] == 0
    assert throughput_run["stdout"].strip() == throughput_run["md"].strip()
    md = throughput_run["md"]
    for heading in ("## Transport throughput", "## Raw baselines", "## Where the time goes",
                    "## Codec CPU cost", "## Targets", "## Notes"):  # fmt: skip
        assert heading in md
    assert "## TTFT breakdown" not in md
    assert "python -m pdserve.bench.transfer.transfer_bench --model" in md
    assert "--no-ttft" in md and "load average" in md and "- code: git " in md


def test_json_has_machine_layout_and_settings(throughput_run: dict[str, Any]) -> None:
    data = throughput_run["json"]
    m = data["machine"]
    assert m["cpu"] and m["cores"] >= 1 and m["threads"] == 1 and m["torch"] and m["libzmq"]
    assert len(m["load_average"]) == 3 and len(m["load_average_end"]) == 3
    assert set(m["load_by_part"]) == {"throughput", "baselines", "codecs"}
    lay = data["layout"]
    assert (lay["layers"], lay["kv_heads"], lay["head_dim"], lay["dtype"]) == (2, 2, 16, "float32")
    assert lay["bytes_per_token"] == TINY_BYTES_PER_TOKEN
    assert data["settings"]["sizes"] == [8, 16] and data["settings"]["repeats"] == 1
    assert data["date"] and data["command"].startswith(
        "python -m pdserve.bench.transfer.transfer_bench"
    )
    assert data["ttft"] == []


def test_throughput_rows(throughput_run: dict[str, Any]) -> None:
    rows = throughput_run["json"]["throughput"]
    keys = [(r["transport"], r["tokens"], r["codec"]) for r in rows]
    assert keys == [(t, n, c) for t in ("tcp", "shm") for n in (8, 16) for c in ("none", "int8")]
    for r in rows:
        assert r["frames"] == 2 and r["inline_frames"] == 0
        assert r["raw_bytes"] == r["tokens"] * TINY_BYTES_PER_TOKEN
        assert r["seconds"] > 0 and len(r["samples_s"]) == 1
        assert r["effective_gbs"] == pytest.approx(r["raw_bytes"] / r["seconds"] / 1e9)
        assert r["wire_gbs"] == pytest.approx(r["wire_bytes"] / r["seconds"] / 1e9)
        if r["codec"] == "none":  # the tensors' bytes plus one header per frame
            assert r["raw_bytes"] < r["wire_bytes"] < r["raw_bytes"] + 2 * 400
            assert r["ratio"] == pytest.approx(r["effective_gbs"] / r["baseline_gbs"])
        else:
            assert r["wire_bytes"] < r["raw_bytes"] and r["ratio"] is None
        assert r["baseline"] == {"tcp": "tcp socket", "shm": "memcpy x2"}[r["transport"]]
        stages = r["stages"]
        assert set(stages) == {key for key, _ in tr._STAGES}
        assert all(v >= 0 for v in stages.values()), stages
        assert stages["total_s"] == pytest.approx(r["seconds"])
        assert stages["last_frame_s"] <= stages["total_s"]
        assert stages["decoded_tensors"] == 2 * r["frames"]  # K and V of one layer per frame
        assert 0 <= stages["in_place_tensors"] <= stages["decoded_tensors"]


def test_baselines_codecs_and_crc(throughput_run: dict[str, Any]) -> None:
    data = throughput_run["json"]
    got = {(b["kind"], b["tokens"]) for b in data["baselines"]}
    assert got == {(k, n) for k in ("memcpy x2", "copy", "tcp socket") for n in (8, 16)}
    for b in data["baselines"]:
        assert b["nbytes"] == b["tokens"] * TINY_BYTES_PER_TOKEN and b["gbs"] > 0
    codecs = [(c["codec"], c["tokens"]) for c in data["codecs"]]
    assert codecs == [("none", 8), ("int8", 8), ("none", 16), ("int8", 16)]
    for c in data["codecs"]:
        assert c["encode_gbs"] > 0 and c["decode_gbs"] > 0 and c["wire_bytes"] > 0
    assert data["crc32_gbs"] > 0


def test_targets_cover_each_transport(throughput_run: dict[str, Any]) -> None:
    targets = throughput_run["json"]["targets"]
    assert [t["name"].split(":")[0] for t in targets] == ["tcp", "shm"]
    assert all(t["status"] in ("met", "missed") for t in targets)


@pytest.mark.slow  # starts a real 1P1D cluster (~20 s)
def test_ttft_breakdown_fields(ttft_run: dict[str, Any]) -> None:
    assert ttft_run["rc"] == 0
    data = ttft_run["json"]
    assert data["throughput"] == [] and data["baselines"] == []
    rows = data["ttft"]
    assert [(r["transport"], r["stream_kv"], r["prompt_tokens"]) for r in rows] == [
        ("tcp", True, 32),
        ("tcp", False, 32),
    ]
    for r in rows:
        assert r["errors"] == [] and len(r["samples"]) == 1
        assert set(r["medians"]) == set(BREAKDOWN)
        assert all(v >= 0 for v in r["medians"].values()), r["medians"]
        assert r["exposed_pct"] is not None and r["exposed_pct"] >= 0
        assert r["transfer_s"] is not None and r["kv_bytes"] > 32 * TINY_BYTES_PER_TOKEN
        md = r["medians"]
        assert md["ttft"] >= md["prefill"] and md["time_to_decode"] >= md["ttft"]
    # The only TTFT target is at 2048 tokens, which this run did not measure.
    assert [t["status"] for t in data["targets"]] == ["n/a"]
    assert "## TTFT breakdown" in ttft_run["md"]


def test_breakdown_arithmetic_and_clamp() -> None:
    timeline = [
        ("dispatch", "attempt 1", 10.0),
        ("recv:expect", "D0", 10.01),
        ("send:received", "P0", 10.02),
        ("send:prefill_start", "P0", 10.05),
        ("recv:reserved", "D0", 10.06),
        ("send:ready", "P0", 10.07),
        ("recv:first_frame", "D0", 10.1),
        ("recv:done", "D0", 10.45),  # before P's first token: nothing exposed
        ("send:first_token", "P0", 10.5),
        ("first_token", "P0", 10.52),
        ("send:done_sent", "P0", 10.53),
        ("first_token", "D0", 10.6),
        ("send:acked", "P0", 10.61),
        ("finish", "D0", 10.7),
    ]
    b = tb.breakdown(timeline)
    assert b["queue"] == pytest.approx(0.05)
    assert b["prefill"] == pytest.approx(0.45)
    assert b["exposed"] == 0.0
    assert b["first_decode"] == pytest.approx(0.15)
    assert b["ttft"] == pytest.approx(0.52)
    assert b["time_to_decode"] == pytest.approx(0.6)
    assert b["transfer"] == pytest.approx(0.38)
    late = [(e, w, 10.55 if e == "recv:done" else t) for e, w, t in timeline]
    assert tb.breakdown(sorted(late, key=lambda e: e[2]))["exposed"] == pytest.approx(0.05)
