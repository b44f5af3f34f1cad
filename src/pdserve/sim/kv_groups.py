"""The simulated model's sliding-window layers: a worker's KV managers and a hand-off's bytes.

A step model may carry `sliding_window` and `layer_kinds` ("s" sliding or "f" full per layer,
"" when no layer slides), as `ModelShape` (through `RooflineStep`) and `CostModelStep` do; one
that carries neither (a test's fixed step model) has no window.

  * `kv_manager`: the engine's own choice and sizing (engine/kv_build.py `choose_manager`),
    finished conversation turns kept on simulated time (engine/kept_turns.py),
    over the memory of `instance_kv_blocks` blocks of every layer: two KV groups for a model
    mixing sliding and global layers (`hybrid_kv.split_blocks` sizes them), one manager that
    frees what leaves the window for a model windowed on every layer, one plain manager
    otherwise. With a KV pool a simulated mixed model keeps one block table (every layer's KV
    in each block: sim/worker.py loads pool hits through one manager), where the engine keeps
    both groups and each puts its own layers (engine/pool_link.py): the simulator then counts
    the sliding layers' full context against memory, as an engine without groups would.
  * `complete_from` and `handoff_bytes`: P sends a sliding layer only its window's KV
    (`ModelArch.kv_needed_from`), every other layer all of it.
  * `windows_from_flags`: `--sliding-window` / `--sliding-layers` over what a config says.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.engine.hybrid_kv import HybridKVCacheManager, KVManager
from pdserve.engine.kv_build import choose_manager
from pdserve.engine.scheduler import SchedulerPolicy
from pdserve.sim.hardware import check_windows
from pdserve.sim.records import SimConfig
from pdserve.sim.steptime import StepModel, instance_kv_blocks


def windows(step: StepModel) -> tuple[int | None, str]:
    """(window, layer kinds) of the step model's model; (None, "") when it says nothing."""
    return getattr(step, "sliding_window", None), getattr(step, "layer_kinds", "")


def kv_manager(
    step: StepModel,
    config: SimConfig,
    policy: SchedulerPolicy,
    clock: Callable[[], float] | None = None,
) -> KVManager:
    """What the engine would build for this model, memory and scheduler budgets; finished
    conversation turns kept `conversation_ttl_s` (multi-turn reuse on) of `clock`'s time."""
    window, kinds = windows(step)
    ttl = config.conversation_ttl_s if config.multiturn_reuse else 0.0
    kv, _ = choose_manager(
        instance_kv_blocks(step, config.block_size), config.block_size, window, kinds,
        prefix_caching=config.prefix_caching, max_num_seqs=policy.max_num_seqs,
        max_num_batched_tokens=policy.max_num_batched_tokens, groups=not config.kv_pool,
        conversation_ttl_s=ttl,
    )  # fmt: skip
    if clock is not None:  # simulated time, where the engine reads time.monotonic
        for group in kv.groups if isinstance(kv, HybridKVCacheManager) else (kv,):
            group.kept.clock = clock
    return kv


def complete_from(step: StepModel, num_tokens: int) -> int:
    """The first of `num_tokens` prompt tokens whose KV a hand-off sends for every layer
    (`ModelArch.kv_complete_from`): the window's first key when some layer slides, else 0."""
    window, kinds = windows(step)
    if window is None or "s" not in kinds:
        return 0
    return max(0, num_tokens - window + 1)


def handoff_bytes(step: StepModel, lo: int, hi: int, window_from: int) -> float:
    """Bytes of the KV of tokens [lo, hi) that P sends: every layer's for the global layers,
    the sliding layers' only from `window_from` (`complete_from`) on."""
    tokens = max(0, hi - lo)
    bpt = step.kv_bytes_per_token
    _, kinds = windows(step)
    if "s" not in kinds:
        return tokens * bpt  # every layer, every token (as without windows)
    sliding = kinds.count("s") / len(kinds)  # the sliding layers' share of a token's bytes
    windowed = max(0, hi - max(lo, window_from))
    return tokens * bpt * (1 - sliding) + windowed * bpt * sliding


def layer_pattern(spec: str, layers: int) -> str:
    """`--sliding-layers`: "all", or a pattern of s (sliding) and f (full) repeated over the
    layers from the first ("sf": Gemma 2's even layers; "sssssf": Gemma 3's five of six); a
    pattern as long as the model names each layer."""
    text = spec.strip().lower()
    if text == "all":
        return "s" * layers
    if not text or set(text) - {"s", "f"}:
        raise ValueError(f"--sliding-layers {spec!r}: give 'all' or a pattern of s and f")
    return (text * (layers // len(text) + 1))[:layers]


def windows_from_flags(
    name: str,
    layers: int,
    given: tuple[int | None, str],
    window: int | None,
    pattern: str | None,
) -> tuple[int | None, str]:
    """The config's (window, layer kinds) with the flags over them: `window` alone resizes
    the config's window (every layer slides when the config has none), `pattern` alone
    chooses the layers of the config's window."""
    if window is None and pattern is None:
        return given
    kinds = layer_pattern(pattern, layers) if pattern is not None else given[1] or "s" * layers
    window = window if window is not None else given[0]
    if window is None:
        raise ValueError(f"model {name} has no sliding window: give --sliding-window")
    check_windows(name, layers, window, kinds)
    return window, kinds
