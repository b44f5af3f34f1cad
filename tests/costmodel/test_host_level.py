"""The host-level probe (costmodel/host_level.py): its factors against a cost model by hand, the
subprocess's answer read back or its failure said, and the real probe on a tiny random Llama."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pdserve.costmodel import host_level as hl
from pdserve.costmodel.model import CostModel

# prefill 10 ms + 1 ms a token; decode 5 ms + 1 ms a request, nothing per context token
MODEL = CostModel((0.01, 0.001, 0.0), (0.005, 0.001, 0.0))


def test_factors_are_measured_over_priced_steps() -> None:
    # priced: a 512-token prompt 10 + 512 = 522 ms; a batch of 8: 5 + 8 = 13 ms
    level = hl.level_of(MODEL, 1.044, 0.026, 4140, seconds=9.0)
    assert level.prefill_x == pytest.approx(2.0) and level.decode_x == pytest.approx(2.0)
    assert json.loads(json.dumps(level.as_dict())) == {
        "prefill_x": level.prefill_x, "decode_x": level.decode_x, "prefill_s": 1.044,
        "decode_s": 0.026, "decode_context": 4140, "seconds": 9.0,
    }  # fmt: skip
    with pytest.raises(ValueError, match="> 0"):
        hl.level_of(MODEL, 0.0, 0.026, 4140)


def _fake_run(rc: int, stdout: str, stderr: str, seen: list[list[str]]) -> Any:
    def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, rc, stdout, stderr)

    return run


def test_measure_reads_the_probe_and_says_when_it_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "cm.json"
    MODEL.save(path)
    seen: list[list[str]] = []
    answer = json.dumps({"prefill_s": 0.522 * 1.5, "decode_s": 0.013 * 3, "decode_context": 4140})
    monkeypatch.setattr(subprocess, "run", _fake_run(0, "loading\n" + answer + "\n", "", seen))
    level = hl.measure(path, "m.gguf", 2, {"prefill_format": "bf16", "other": "x"})
    assert level.prefill_x == pytest.approx(1.5) and level.decode_x == pytest.approx(3.0)
    cmd = seen[0]
    assert cmd[cmd.index("--threads") + 1] == "2" and cmd[cmd.index("--model") + 1] == "m.gguf"
    assert cmd[cmd.index("--prefill-format") + 1] == "bf16" and "--other" not in cmd
    monkeypatch.setattr(subprocess, "run", _fake_run(1, "", "a\nb\nno such model\n", seen))
    with pytest.raises(RuntimeError, match="no such model"):
        hl.measure(path, None, 1, {})
    with pytest.raises(ValueError, match="threads"):
        hl.measure(path, None, 0, {})


@pytest.mark.slow
def test_the_probe_times_a_real_engine(tiny_llama_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "cm.json"
    MODEL.save(path)
    level = hl.measure(path, str(tiny_llama_path), 1, {"quantization": "none"})
    assert level.prefill_s > 0 and level.decode_s > 0 and level.seconds > level.prefill_s
    assert level.decode_context >= hl.DECODE_BATCH * hl.DECODE_CONTEXT
    # a tiny model's steps are far below this model's milliseconds
    assert level.prefill_x < 1 and level.decode_x < 1


def test_a_rescaled_model_keeps_its_profiles_about_and_contention(tmp_path: Path) -> None:
    from pdserve.costmodel.contention import Contention

    profile = tmp_path / "cm.json"
    MODEL.save(profile, kv_bytes_per_token=100, threads=2)
    Contention(1.1, 1.0, 1.2, 1.0, 1, 2).save_into(profile)
    out = hl.save_rescaled(profile, MODEL.rescaled(2.0, 3.0), tmp_path / "x.json", threads=1)
    assert CostModel.load(out) == MODEL.rescaled(2.0, 3.0)
    assert CostModel.load_about(out) == {"kv_bytes_per_token": 100, "threads": 1}
    assert Contention.load(out) == Contention.load(profile)
    plain = tmp_path / "plain.json"
    MODEL.save(plain)
    assert not Contention.load(hl.save_rescaled(plain, MODEL, tmp_path / "y.json")).measured
