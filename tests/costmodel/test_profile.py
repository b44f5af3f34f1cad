"""`pdserve bench profile` on a tiny random Llama with the quick grid: the samples are real and
positive, the fitted model predicts them loosely (a tiny model's millisecond steps on a shared
machine are noisy, so no tight bound), and `load_or_profile` profiles once, then reuses the file.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import cli
from pdserve.costmodel import measure, profile
from pdserve.costmodel.model import CostModel, default_path

LOOSE = 1.0  # median relative error: a fit that is off by 2x on its own samples is broken


@pytest.fixture(scope="module")
def quick(tiny_llama_path: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    return profile.profile_engine(str(tiny_llama_path), 1, quick=True)


def test_samples_are_positive_and_cover_the_grid(quick: dict[str, Any]) -> None:
    pre, dec, xfer = quick["prefill"], quick["decode"], quick["transfer"]
    assert len(pre) >= 4 and len(dec) >= 4 and len(xfer) >= 2
    assert all(n > 0 and c >= 0 and s > 0 for n, c, s in pre)
    assert any(c > 0 for _, c, _ in pre), "no cached-prefix sample"
    assert all(c % measure.BLOCK_SIZE == 0 for _, c, _ in pre)
    assert all(b > 0 and ctx >= b and s > 0 for b, ctx, s in dec)
    assert {b for b, _, _ in dec} == set(measure.QUICK.batches)
    assert all(n > 0 and s > 0 for n, s in xfer)
    # D's part of each transfer point (decode_frame + write_kv), per token count sent
    assert [n for n, _ in quick["receive"]] == list(measure.QUICK.transfer_tokens)
    assert all(s > 0 for _, s in quick["receive"])
    assert 0 < quick["seconds"] < 120


def test_the_fit_predicts_its_own_samples(quick: dict[str, Any]) -> None:
    model, err = quick["model"], quick["errors"]
    assert isinstance(model, CostModel)
    assert err["prefill_p50"] < LOOSE and err["decode_p50"] < LOOSE, err
    assert model.prefill_s(128) > 0 and model.decode_step_s(4, 256) > 0
    # a term per profiled batch size, and the one-line fit's error kept for comparison
    assert [b for b, _ in model.decode_by_batch] == list(measure.QUICK.batches)
    assert "decode_linear_p50" in err and model.receive_s(64) > 0
    about = quick["about"]
    assert about["threads"] == 1 and about["samples"]["prefill"] == len(quick["prefill"])
    assert about["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # layers, kv heads, head dim, fp32


def test_grid_points_respect_max_prompt() -> None:
    assert max(measure.prefill_points(measure.FULL, 1000)) == 1000
    for cached, new in measure.cached_points(measure.FULL, 2048):
        assert cached % measure.BLOCK_SIZE == 0 and cached + new <= 2048 and new >= 1


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="threads"):
        profile.profile_engine(None, 0)
    with pytest.raises(ValueError, match="max_prompt"):
        profile.profile_engine(None, 1, max_prompt=8)


def test_load_or_profile_profiles_once(
    tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    calls: list[int] = []
    real = profile.profile_engine

    def counting(*args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(profile, "profile_engine", counting)
    first = profile.load_or_profile(str(tiny_llama_path), 1, quick=True)
    path = default_path(str(tiny_llama_path), 1)
    assert path.is_file() and path.is_relative_to(tmp_path) and calls == [1]
    about = CostModel.load_about(path)
    assert about["threads"] == 1 and about["model"] == str(tiny_llama_path.resolve())
    assert profile.load_or_profile(str(tiny_llama_path), 1, quick=True) == first
    assert calls == [1], "the second call profiled again"
    # a corrupt file is profiled again and overwritten
    path.write_text("{")
    profile.load_or_profile(str(tiny_llama_path), 1, quick=True)
    assert calls == [1, 1] and CostModel.load(path)


def test_cli_writes_the_model_and_samples(tiny_llama_path: Path, tmp_path: Path) -> None:
    out, raw = tmp_path / "cm.json", tmp_path / "samples.json"
    argv = ["bench", "profile", "--model", str(tiny_llama_path), "--threads", "1", "--quick",
            "--out", str(out), "--samples-out", str(raw)]  # fmt: skip
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(argv)
    assert rc == 0
    text = buf.getvalue()
    assert "prefill p1" in text and "decode d2" in text and str(out) in text
    assert CostModel.load(out).prefill_s(100) > 0
    samples = json.loads(raw.read_text())
    assert samples["prefill"] and samples["decode"] and samples["transfer"]


def test_decode_points_pool_their_steps_over_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each (batch, context) is timed once per round, and its sample is the median of every
    round's steps: a slow spell during one round moves it less than a point timed once."""
    calls: list[tuple[int, int]] = []
    # round 1 fast, round 2 slow, round 3 fast: per point 3 steps each
    speed = {0: 0.010, 1: 0.050, 2: 0.011}

    def fake_times(engine: Any, ids: Any, batch: int, context: int, steps: int) -> Any:
        if batch == 3:
            return None  # does not fit: skipped, and not tried again
        rnd = sum(1 for c in calls if c == (batch, context))
        calls.append((batch, context))
        return [speed[rnd] * batch] * steps, [batch * context] * steps

    monkeypatch.setattr(measure, "decode_times", fake_times)
    grid = measure.Grid((8,), (), (), (1, 2, 3), (16, 64), 3, (), decode_rounds=3)
    samples = measure.measure_decode(None, None, grid, max_prompt=64)  # type: ignore[arg-type]
    assert len(calls) == 3 * 4  # rounds x fitting points, in grid order each round
    assert calls[:4] == [(1, 16), (2, 16), (1, 64), (2, 64)] == calls[4:8]
    assert sorted(samples) == [(1, 16, 0.011), (1, 64, 0.011), (2, 32, 0.022), (2, 128, 0.022)]


def test_prefill_points_are_timed_in_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fresh prompt length is timed once per pass, the lengths in order each pass, and
    its sample is the median over the passes: a slow spell in one pass moves no point."""
    calls: list[int] = []

    def fake_prefill(engine: Any, ids: Any, n: int) -> float:
        rnd = calls.count(n)
        calls.append(n)
        return n * (0.005 if rnd == 1 else 0.001)  # the second pass is 5x slower

    monkeypatch.setattr(measure, "_fresh_prefill", fake_prefill)
    grid = measure.Grid((16, 64), (), (), (1,), (16,), 3, (), prefill_rounds=3)
    samples = measure.measure_prefill(None, None, grid, max_prompt=128)  # type: ignore[arg-type]
    assert calls == [16, 64, 128] * 3
    assert samples == [(16, 0, 0.016), (64, 0, 0.064), (128, 0, 0.128)]


def test_kv_bytes_per_token_are_the_cache_dtype_s(tiny_llama_path: Path) -> None:
    """A float16 cache beside float32 weights holds (and hands off) 2 bytes an element: the
    simulator sizes D's KV memory from this, so the model's dtype would halve it."""
    from pdserve import LLM
    from pdserve.costmodel.profile_transfer import kv_bytes_per_token

    llm = LLM(str(tiny_llama_path), kv_cache_dtype="float16")
    assert kv_bytes_per_token(llm.engine) == 2 * 2 * 2 * 16 * 2  # layers, kv heads, dim, fp16
