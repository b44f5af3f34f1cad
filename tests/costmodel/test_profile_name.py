"""One name for this host's cost-model file: `pdserve serve`, `bench profile`, `plan` and
`sim --hardware cpu` compute it with `profile.profile_path` (issue 48: sim looked for
`...-Q4_1-t1.json` right after serve had profiled into `...-gguf-a16-kv-float16-t1.json`)."""

from __future__ import annotations

import argparse

import pytest

from pdserve import cli
from pdserve.costmodel import plan_cli
from pdserve.costmodel.profile import profile_path
from pdserve.serve import flags, plan
from pdserve.sim.deploy import Deployment, cost_model_path


@pytest.fixture(autouse=True)
def _empty_cache(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))


def _serve_default_path() -> str:
    parser = argparse.ArgumentParser()
    flags.add_serve_arguments(parser)
    return str(plan.cost_path(flags.deployment(parser.parse_args([])), 1))


def test_serve_sim_plan_and_profile_name_the_same_file() -> None:
    served = _serve_default_path()
    assert "-gguf-a16-kv-float16-" in served  # the default model's engine settings
    assert str(cost_model_path(Deployment(hardware="cpu", model="default"))) == served
    assert str(plan_cli._default_cost_model(None)) == served
    # `bench profile --threads 1` with its defaults, and with `auto` spelled out
    assert str(profile_path(None, 1)) == served
    spelled = profile_path(None, 1, quantization="gguf-a16", kv_cache_dtype="float16")
    assert str(spelled) == served


def test_sim_without_a_profile_says_which_command_makes_it(capsys) -> None:  # type: ignore[no-untyped-def]
    code = cli.main(["sim", "--hardware", "cpu", "--colocated", "1", "--num-requests", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert _serve_default_path() in err
    assert "pdserve bench profile --threads 1" in err and "Traceback" not in err
