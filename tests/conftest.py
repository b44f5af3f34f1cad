"""Shared fixtures: tiny random HF models (Llama, Qwen2 with bias) saved as safetensors folders
with the default model's tokenizer (once per session), and the default SmolLM2 engine (once per
module)."""

from __future__ import annotations

import fcntl
import gc
import os
import tempfile
from pathlib import Path

import pytest
import torch

from factories import TINY_VOCAB, assert_engine_idle, share_model_conversions

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests never see this host's saved cost models (one turns on SLO routing for a server started
# without flags, so a request may run whole on D) nor leave theirs behind for later runs.
os.environ.setdefault("PDSERVE_CACHE_DIR", tempfile.mkdtemp(prefix="pdserve-test-cache-"))


share_model_conversions(Path(os.environ["PDSERVE_CACHE_DIR"]))


def _save_tiny(folder: Path, kind: str, tokenizer) -> Path:  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    cfg = cfg_cls(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=kind == "qwen2",
        bos_token_id=1,
        eos_token_id=2,
        rope_theta=10000.0,
    )
    torch.manual_seed(1234)
    model = model_cls(cfg)
    if kind == "qwen2":  # random non-zero biases so the bias path is really exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def default_tokenizer():  # type: ignore[no-untyped-def]
    from pdserve.engine import loader

    return loader.load_tokenizer(loader.resolve_model(None))


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, default_tokenizer) -> Path:  # type: ignore[no-untyped-def]
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama", default_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory, default_tokenizer) -> Path:  # type: ignore[no-untyped-def]
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", default_tokenizer)


# A Hermes/Qwen-style chat template that knows tools (written for the tests): the tools go into
# the system turn, calls are `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}<tool_call>"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>'
    "{%- endfor %}{%- else %}{{ m.content }}{%- endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tool_tokenizer(default_tokenizer):  # type: ignore[no-untyped-def]
    """The default tokenizer with TOOL_TEMPLATE as its chat template."""
    import copy

    tok = copy.deepcopy(default_tokenizer)
    tok.chat_template = TOOL_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def tiny_tool_llama_path(tmp_path_factory, tool_tokenizer) -> Path:  # type: ignore[no-untyped-def]
    """The tiny Llama with a chat template that knows tools."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-tool-llama"), "llama", tool_tokenizer)


@pytest.fixture(scope="module")
def smollm2():  # type: ignore[no-untyped-def]
    """The default model, loaded once per module that uses it (~3 s; ~9 s for a pytest process's
    first, which converts its GGUF header into the cache). Not per session: an engine holding
    it took ~2.2 GB (1.5 GB now), which a session fixture kept in each pytest worker for the
    rest of the slow run, next to the other tests' servers (a CI run on 24 GiB was OOM-killed)."""
    from pdserve import LLM

    yield LLM()
    gc.collect()  # free the engine now should it sit in reference cycles, not at a later collection


# ---- which tests are slow: decided here, in one place -------------------------------------------
# `make test-fast` runs `-m "not slow"`. Slow: a test that starts worker processes, a real cluster
# or a server, runs for many seconds by design, or loads the real default model.
SLOW_MODULES = {
    "test_chaos.py",  # a 40 s chaos run
    "test_cluster.py",  # LocalCluster: tcp/ipc/shm worker processes
    "test_dashboard_browser.py",  # `pdserve serve` under load + headless chromium
    "test_netns.py",  # worker processes in network namespaces
    "test_prefix_transfer.py",  # real clusters
    "test_window_handoff.py",  # real clusters with sliding-window models
    "test_cluster_pool.py",  # real (inproc) clusters sharing a KV pool
    "test_conversation_e2e.py",  # inproc 1P1D clusters: conversations kept on D
    "test_recovery.py",  # worker processes killed and stalled, liveness timeouts
    "test_scheduling_e2e.py",  # real clusters under the SLO planner
    "test_adaptive_e2e.py",  # real clusters: D prefilling under bursts, threads moving
    "test_serve.py",  # `pdserve serve` subprocesses
    "test_api_conformance.py",  # `pdserve serve` colocated and 1P1D, the openai client
    "test_smollm2.py",  # the default model
    "test_ray_cluster.py",  # a multi-node Ray cluster with worker actors
    "test_ray_fractional.py",  # a local Ray with worker actors
    # transformers' float32 references of many tiny models (about a minute between them): the
    # GGUF architectures against their config.json twins, windowed KV against transformers
    "test_gguf_architectures.py",
    "test_window_kv.py",
    "test_hybrid_pool.py",  # KV groups through a KV pool, against transformers (~15 s)
    "test_spec_engine.py",  # speculation against plain decoding, tiny model (~12 s)
    "test_core_spec.py",  # in-process 1P1D workers speculating on D (~4 s)
    # the fast tier's heaviest modules on 2 cores (CPU seconds of `--durations=0`), moved so it
    # keeps under two minutes with room for a slow host
    "test_scheduling.py",  # fake-worker clusters under the SLO planner and balancer (~10 s)
    "test_model_parity.py",  # logits against transformers, several tiny models (~9 s)
    "test_architectures.py",  # every architecture against transformers (~6 s)
}
# Slow tests whose pass depends on the wall clock, so `make test` runs them alone after the
# rest (which run two at a time): the chaos run must fit its faults into 40 s, and beside
# another test its restarts missed that window.
SERIAL_MODULES = {"test_chaos.py"}
SLOW_FIXTURES = {"smollm2"}  # the default model: seconds to load, GBs to hold
# Tests holding the default model, some in several processes at once (~2 GB each), run one at
# a time (`default_model` mark, the `_one_default_model_test_at_a_time` lock below), the other
# xdist worker going on with other tests. Side by side, a default-model server and a
# default-model 1P1D cluster took ~11 GB; in CI runs on 24 GiB (beside a third test) they were
# once OOM-killed and once had a decode worker stall 30 s ("stuck") mid-request. (xdist's
# `--dist loadgroup` would do this, but with pytest 9.2 it no longer groups: it renames
# `item._nodeid`, which pytest 9 no longer reads.)
DEFAULT_MODEL_FIXTURES = {"smollm2"}
DEFAULT_MODEL_TESTS = {
    "test_serve.py::test_default_model_answers_paris_over_http",  # a 1P1D default-model server
    "test_loader.py::test_default_gguf_weights_match_transformers",  # ours and transformers'
}
SLOW_TESTS = {
    "test_loader.py::test_default_gguf_weights_match_transformers",  # the default model
    "test_loader.py::test_default_gguf_tokenizer",
    "test_loader.py::test_gguf_tokenizer_is_converted_once_then_loaded_from_the_cache",
    "test_compare.py::test_compare_end_to_end_on_tiny_model",  # servers in subprocesses
    "test_auth.py::test_cluster_with_a_shared_secret_serves_and_rejects_untagged",
    "test_auth.py::test_worker_refuses_a_network_address_without_a_secret",
    # a whole sweep through the CLI (a fake server, 4 phases, the plot): 8 s alone, 30 s in the
    # fast tier beside the other process
    "test_sweep.py::test_sweep_against_a_fake_server",
    # LocalCluster with tcp worker processes (~10 s of start-up): the in-process checks of the
    # same freezing and pause accounting stay in the fast tier (the rest of test_gc_pauses.py)
    "test_gc_pauses.py::test_worker_processes_report_their_frozen_heap_and_pauses",
    # the TTFT part of `pdserve bench transfer`: two tcp 1P1D LocalClusters (worker processes,
    # ~14 s); its timeline arithmetic stays fast (test_breakdown_arithmetic_and_clamp), and so
    # does the throughput part of the same CLI
    "test_transfer_bench.py::test_ttft_breakdown_fields",
}


def pytest_collection_modifyitems(config, items) -> None:  # type: ignore[no-untyped-def]
    for item in items:
        name = f"{item.path.name}::{item.originalname}"
        if (
            item.path.name in SLOW_MODULES
            or name in SLOW_TESTS
            or SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
        ):
            item.add_marker(pytest.mark.slow)
        if item.path.name in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
        if name in DEFAULT_MODEL_TESTS or DEFAULT_MODEL_FIXTURES & set(
            getattr(item, "fixturenames", ())
        ):
            item.add_marker(pytest.mark.default_model)


@pytest.fixture(autouse=True)
def _one_default_model_test_at_a_time(request):  # type: ignore[no-untyped-def]
    """A `default_model` test waits for any other one (of any pytest process on this machine)
    to end: an flock, which the OS releases should its holder die."""
    if request.node.get_closest_marker("default_model") is None:
        yield
        return
    lock = Path(tempfile.gettempdir()) / "pdserve-tests-default-model.lock"
    with open(lock, "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        yield


# ---- leak checks after every test, by fixture --------------------------------------------------
def _assert_no_leaks_in(value: object) -> None:
    from pdserve import LLM
    from pdserve.cluster import LocalCluster

    if isinstance(value, LLM):
        assert_engine_idle(value)
    elif isinstance(value, LocalCluster) and value.core is not None:
        from factories import assert_cluster_idle

        assert_cluster_idle(value)


def _idle(obj: object) -> bool:
    """Nothing alive in a scheduler or KV manager: then nothing may hold memory either."""
    from pdserve.engine.hybrid_kv import HybridKVCacheManager
    from pdserve.engine.kv_cache_manager import KVCacheManager
    from pdserve.engine.scheduler import Scheduler

    if isinstance(obj, Scheduler):
        return not obj.requests and not obj.held
    if isinstance(obj, HybridKVCacheManager):
        return all(_idle(g) for g in obj.groups)
    return isinstance(obj, KVCacheManager) and not obj._blocks


@pytest.fixture(autouse=True)
def _leak_check(request):  # type: ignore[no-untyped-def]
    """After each test, every engine (`LLM`) and open `LocalCluster` it used as a fixture must
    hold nothing: no live request, every KV block free, no transfer pending (shared fixtures are
    where a leak would otherwise carry over into the next test unseen); and every scheduler or
    KV manager the factories made that has nothing alive must hold no block either."""
    from factories import assert_no_leaks, take_made

    take_made()
    yield
    made = take_made()
    if getattr(request.node, "rep_call_failed", True):
        return  # the test's own failure says more than a leak it caused
    for value in request.node.funcargs.values():
        _assert_no_leaks_in(value)
    for obj in made:
        if _idle(obj):
            assert_no_leaks(obj)  # type: ignore[arg-type]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    outcome = yield
    if call.when == "call":
        item.rep_call_failed = outcome.get_result().failed
