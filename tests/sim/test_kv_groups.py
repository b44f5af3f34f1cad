"""The simulator's KV for models with sliding-window layers (sim/kv_groups.py): the engine's own
KV groups, sized as the engine sizes them, the hand-off's window-only bytes, and models without
a window simulated exactly as before."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from factories import assert_no_leaks
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.hybrid_kv import HybridKVCacheManager, split_blocks
from pdserve.engine.kv_build import build_kv
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_window import cdiv
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.hf_config import arch_from_config
from pdserve.engine.scheduler import SchedulerPolicy
from pdserve.sim import kv_groups
from pdserve.sim.cluster import Simulation
from pdserve.sim.deploy import Deployment, _gpu_shape, simulate
from pdserve.sim.hardware import CONFIG_DIR, Gpu, model_shape
from pdserve.sim.records import SimConfig, SimRequest
from pdserve.sim.steptime import Link, RooflineStep, instance_kv_blocks

BS = SimConfig.block_size


@dataclass(frozen=True)
class WindowStep:
    """A fixed-cost step model of a 4-layer model whose layers may slide."""

    sliding_window: int | None = None
    layer_kinds: str = ""
    kv_bytes_per_token: float = 100.0
    layers: int = 4
    gpus: int = 1
    tokens: int = 1000 * BS  # 1000 blocks of every layer

    def step_s(self, rows: Sequence[tuple[int, int]]) -> float:
        return 0.01 + 1e-5 * sum(n for n, _ in rows)

    def receive_s(self, tokens: int) -> float:
        return 0.0

    def kv_tokens(self) -> int:
        return self.tokens


MIXED = WindowStep(sliding_window=64, layer_kinds="sssf")


def prompts(n: int, length: int, max_tokens: int, t: float = 0.0) -> list[SimRequest]:
    """`n` prompts sharing no block (no prefix hits)."""
    return [
        SimRequest(f"r{i}", t, [100_000 * (i + 1) + j for j in range(length)], max_tokens)
        for i in range(n)
    ]


def peak_decoding(sim: Simulation, requests: list[SimRequest]) -> int:
    """The most requests one step decoded: each holds its whole prompt's KV."""
    peak = 0
    run_step = sim.run_step

    def counted(wid, rows, work, done, kind=""):  # type: ignore[no-untyped-def]
        nonlocal peak
        peak = max(peak, sum(n == 1 and start > 0 for n, start in rows))
        run_step(wid, rows, work, done, kind)

    sim.run_step = counted  # type: ignore[method-assign]
    records = sim.run(requests)
    assert all(r.finished_at is not None for r in records)
    for w in sim.workers:
        assert_no_leaks(w.sched)
    return peak


def test_a_mixed_window_model_holds_more_long_requests_at_once() -> None:
    """Three sliding layers of four hold only their window: the same memory holds
    split_blocks's global group of long prompts (the sliding group is not the limit)."""
    policy = SchedulerPolicy(max_num_batched_tokens=2048, max_num_seqs=64)
    cfg = SimConfig(colocated=1, policy=policy)
    reqs = prompts(40, 1000, 100)
    per_prompt = cdiv(1000 + 1, BS)  # a prompt's blocks once its first token is sampled
    blocks = instance_kv_blocks(MIXED, BS)
    size = split_blocks(blocks, 4, 3, 64, BS, policy.max_num_seqs, policy.max_num_batched_tokens)
    assert size.sliding >= policy.max_num_seqs * (cdiv(64 - 1, BS) + 2)  # room for every row
    plain = peak_decoding(Simulation(cfg, WindowStep(), Link(1e9)), reqs)
    mixed = peak_decoding(Simulation(cfg, MIXED, Link(1e9)), reqs)
    assert plain <= blocks // per_prompt < mixed <= size.full // per_prompt
    assert mixed >= 2 * plain  # 2080 global blocks against 1000


def tiny_config(tmp_path: Path, **fields: object) -> Path:
    """A small model's config.json (Gemma 2 by default: even layers slide)."""
    cfg = {
        "architectures": ["Gemma2ForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1024,
        "max_position_embeddings": 8192,
        "sliding_window": 128,
        **fields,
    }
    folder = tmp_path / str(fields.get("architectures", ["gemma"])[0])  # type: ignore[index]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


# HBM for a few thousand blocks of the tiny model: the engine's cache tensors stay small
TINY_GPU = Gpu("tiny", 1e12, 1e11, 0.05, 1e11)


def engine_manager(folder: Path, num_blocks: int, policy: SchedulerPolicy) -> object:
    """What the engine builds for this config.json and memory (kv_build.build_kv)."""
    arch = arch_from_config(folder)
    config = EngineConfig(
        cache_config=CacheConfig(block_size=BS),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=policy.max_num_batched_tokens, max_num_seqs=policy.max_num_seqs
        ),
    )
    layout = arch.kv_layout(torch.bfloat16)
    _, kv = build_kv(arch, layout, num_blocks, config, torch.device("cpu"))
    return kv


def test_the_sim_builds_the_kv_groups_the_engine_builds(tmp_path: Path) -> None:
    folder = tiny_config(tmp_path)
    shape = model_shape(str(folder))
    assert (shape.sliding_window, shape.layer_kinds) == (128, "sfsfsf")
    step = RooflineStep(TINY_GPU, shape)
    policy = SchedulerPolicy(max_num_batched_tokens=512, max_num_seqs=16)
    sim_kv = kv_groups.kv_manager(step, SimConfig(colocated=1), policy)
    eng_kv = engine_manager(folder, instance_kv_blocks(step, BS), policy)
    assert isinstance(sim_kv, HybridKVCacheManager) and isinstance(eng_kv, HybridKVCacheManager)
    sizes = [(kv.full.num_blocks, kv.sliding.num_blocks, kv.window) for kv in (sim_kv, eng_kv)]
    assert sizes[0] == sizes[1]
    size = split_blocks(instance_kv_blocks(step, BS), 6, 3, 128, BS, 16, 512)
    assert sim_kv.full.num_blocks > instance_kv_blocks(step, BS) > size.sliding
    # with a KV pool the simulated worker keeps one table (its pool loads go through one
    # manager; the engine keeps both groups there: docs/models.md)
    pooled = kv_groups.kv_manager(step, SimConfig(colocated=1, kv_pool=True), policy)
    assert isinstance(pooled, KVCacheManager) and pooled.window is None
    assert pooled.num_blocks == instance_kv_blocks(step, BS)


def test_a_model_windowed_on_every_layer_frees_blocks_leaving_the_window(tmp_path: Path) -> None:
    folder = tiny_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=256)
    shape = model_shape(str(folder))
    assert (shape.sliding_window, shape.layer_kinds) == (256, "s" * 6)
    policy = SchedulerPolicy(max_num_batched_tokens=512, max_num_seqs=16)
    step = RooflineStep(TINY_GPU, shape)
    kv = kv_groups.kv_manager(step, SimConfig(colocated=1), policy)
    eng_kv = engine_manager(folder, instance_kv_blocks(step, BS), policy)
    assert isinstance(kv, KVCacheManager) and isinstance(eng_kv, KVCacheManager)
    assert (kv.window, kv.num_blocks) == (eng_kv.window, eng_kv.num_blocks) == (256, kv.num_blocks)
    # 100 blocks of memory and a 4000-token prompt: it runs only if blocks leave the window
    small = WindowStep(sliding_window=256, layer_kinds="ssss", tokens=100 * BS)
    cfg = SimConfig(colocated=1, policy=policy)
    sim = Simulation(cfg, small, Link(1e9))
    (rec,) = sim.run(prompts(1, 4000, 50))
    assert rec.finished_at is not None and rec.tokens == 50
    assert_no_leaks(sim.workers[0].sched)
    with pytest.raises(ValueError, match="needs more KV blocks than the cache holds"):
        Simulation(cfg, replace(small, sliding_window=None, layer_kinds=""), Link(1e9)).run(
            prompts(1, 4000, 50)
        )


def test_the_hand_off_sends_sliding_layers_their_window_only() -> None:
    """P -> D bytes: each layer from `ModelArch.kv_needed_from` on (what the engine sends)."""
    arch = ModelArch(
        "gemma2", 8, 8, 8, num_layers=4, num_heads=1, num_kv_heads=1, head_dim=8,
        sliding_window=64, layer_types=("sliding", "sliding", "sliding", "full"),
    )  # fmt: skip
    per_layer = MIXED.kv_bytes_per_token / 4
    cfg = SimConfig(prefill=1, decode=1)
    for n in (40, 1000):  # within the window, past it
        want = sum((n - arch.kv_needed_from(i, n)) * per_layer for i in range(4))
        sim = Simulation(cfg, MIXED, Link(1e9))
        (rec,) = sim.run(prompts(1, n, 4))
        assert rec.kv_bytes == int(want)
        (plain,) = Simulation(cfg, WindowStep(), Link(1e9)).run(prompts(1, n, 4))
        assert plain.kv_bytes == n * MIXED.kv_bytes_per_token
    assert rec.kv_bytes < plain.kv_bytes / 3


def test_a_sliding_layer_prices_only_its_window() -> None:
    shape = model_shape("llama-3.1-8b")
    h100 = Gpu("h100", 989e12, 3350e9, 80, 450e9)
    full = RooflineStep(h100, shape)
    mixed = RooflineStep(h100, replace(shape, sliding_window=1024, layer_kinds="sf" * 16))
    short, long = [(1, 500)] * 8, [(1, 30_000)] * 8
    assert mixed.step_s(short) == full.step_s(short)  # every key inside the window
    assert mixed.step_s(long) < full.step_s(long)


def test_models_without_a_window_simulate_as_before(tmp_path: Path) -> None:
    """Qwen2.5's own config names a window it does not use (use_sliding_window false): no
    window, one plain manager, and the same run as the shipped shape's."""
    cfg = json.loads((CONFIG_DIR / "qwen2.5-7b.json").read_text())
    cfg.update(sliding_window=131072, max_window_layers=28, use_sliding_window=False)
    path = tmp_path / "qwen.json"
    path.write_text(json.dumps(cfg))
    assert (model_shape(str(path)).layer_kinds, model_shape(str(path)).sliding_window) == ("", None)
    reqs = prompts(30, 3000, 50)
    reqs = [replace(r, arrival=0.05 * i) for i, r in enumerate(reqs)]
    base = Deployment(hardware="h100", model="qwen2.5-7b", prefill=1, decode=1, max_num_seqs=8)
    got = simulate(replace(base, model=str(path)), reqs)
    want = simulate(base, reqs)
    got.pop("wall_s", None), want.pop("wall_s", None)
    assert got == want
    # and what the flags turn on changes the run: the same workload with a window
    windowed = simulate(replace(base, sliding_window=512, sliding_layers="sf"), reqs)
    assert windowed != want


def test_flags_set_the_window_and_its_layers() -> None:
    d = Deployment(model="llama-3.1-8b", sliding_window=4096, sliding_layers="sssf")
    shape = _gpu_shape(d)
    assert shape.sliding_window == 4096 and shape.layer_kinds == "sssf" * 8
    assert _gpu_shape(replace(d, sliding_layers=None)).layer_kinds == "s" * 32
    assert kv_groups.layer_pattern("sf", 5) == "sfsfs"
    with pytest.raises(ValueError, match="no sliding window"):
        _gpu_shape(replace(d, sliding_window=None))
    with pytest.raises(ValueError, match="pattern of s and f"):
        kv_groups.layer_pattern("sx", 4)
    with pytest.raises(ValueError, match="at least one s"):
        _gpu_shape(replace(d, sliding_layers="f"))
