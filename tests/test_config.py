"""config.py: each process kind's config renders its flags, reads them back, and writes a child's
argv that reads back as the same config; bad values are refused with ValueError."""

from __future__ import annotations

import argparse

import pytest

from pdserve.config import (
    RouterConfig,
    WorkerConfig,
    add_config_args,
    add_engine_overrides,
    config_argv,
    config_from_args,
    engine_overrides,
)
from pdserve.launcher import WorkerSpec, worker_command


def _parse(cls: type, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_args(parser, cls)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "config",
    [
        WorkerConfig(),
        WorkerConfig(transport="shm", kv_codec="int8", deadline_s=1.5, stream_kv=False, cpus="0,1"),
        RouterConfig(),
        RouterConfig(policy="round_robin", liveness_timeout_s=0.5, prefix_routing=False),
    ],
)
def test_argv_reads_back_as_the_same_config(config: object) -> None:
    cls = type(config)
    assert config_from_args(cls, _parse(cls, config_argv(config))) == config


def test_flags_keep_their_names_and_code_only_knobs_have_none() -> None:
    ns = _parse(RouterConfig, ["--deadline", "2", "--liveness-timeout", "1", "--no-prefix-routing"])
    cfg = config_from_args(RouterConfig, ns)
    assert (cfg.deadline_s, cfg.liveness_timeout_s, cfg.prefix_routing) == (2.0, 1.0, False)
    with pytest.raises(SystemExit):
        _parse(RouterConfig, ["--stats-interval-s", "3"])  # cli=False: not a flag


def test_worker_command_is_the_specs_config_and_engine_args() -> None:
    spec = WorkerSpec("decode", "D7", {"block_size": 32, "enable_prefix_caching": False},
                      WorkerConfig(transport="ipc", lease_s=3.0))  # fmt: skip
    cmd = worker_command(spec)
    i = cmd.index("worker")
    assert cmd[i + 1 : i + 5] == ["--role", "decode", "--worker-id", "D7"]
    assert "--lease" in cmd and cmd[cmd.index("--lease") + 1] == "3.0"
    assert cmd[-3:] == ["--block-size", "32", "--no-enable-prefix-caching"]


def test_engine_overrides_pass_on_only_what_was_given() -> None:
    parser = argparse.ArgumentParser()
    names = ("block_size", "kv_cache_memory_gb")
    add_engine_overrides(parser, names)
    assert engine_overrides(parser.parse_args([]), names) == {}
    assert engine_overrides(parser.parse_args(["--block-size", "8"]), names) == {"block_size": 8}


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (WorkerConfig, {"deadline_s": 0}),
        (WorkerConfig, {"shm_mb": -1}),
        (RouterConfig, {"liveness_timeout_s": 0}),
        (RouterConfig, {"max_inflight": 0}),
    ],
)
def test_bad_values_are_refused(cls: type, kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError):
        cls(**kwargs)


@pytest.mark.parametrize(
    ("flag", "field", "good", "bad"),
    [
        ("--quantization", "quantization", "int8", "int3"),
        ("--kv-cache-dtype", "kv_cache_dtype", "float16", "fp8"),
        ("--decode-matmul", "decode_matmul", "torch", "mkl"),
    ],
)
def test_engine_flag_reaches_every_worker_and_the_cli(
    flag: str, field: str, good: str, bad: str
) -> None:
    """An engine flag given to `pdserve serve` is in every worker's spec and command line, and
    `generate` / `worker` read it; a bad value is a ValueError (serve) or exit code 2 (CLI)."""
    from pdserve.cli import build_parser, main
    from pdserve.config import engine_kwargs_from_args
    from pdserve.serve import flags, plan

    parser = argparse.ArgumentParser()
    flags.add_serve_arguments(parser)
    specs = plan.worker_specs(flags.deployment(parser.parse_args([flag, good])))
    assert [s.engine_args[field] for s in specs] == [good, good]
    cmd = worker_command(WorkerSpec("decode", "D0", specs[1].engine_args))
    assert cmd[cmd.index(flag) + 1] == good
    with pytest.raises(ValueError, match=f"{field} must be one of"):
        flags.deployment(parser.parse_args([flag, bad]))
    for command in (["generate", "hi"], ["worker", "--role", "decode"]):
        args = build_parser().parse_args([*command, flag, good])
        assert engine_kwargs_from_args(args)[field] == good
    assert main(["generate", "hi", flag, bad, "--model", "/nonexistent"]) == 2
