"""Plain factories and checkers for the pure engine parts (block pool, KV manager, scheduler).

Kept as functions, not fixtures, so that `tests/conftest.py` stays free for model fixtures.
Import with `from factories import ...` (pytest puts `tests/` on sys.path for its conftest).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
import signal
import socket
import tempfile
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.hybrid_kv import HybridKVCacheManager
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerOutput, SchedulerPolicy

_ids = itertools.count()
# Default prompts are drawn from disjoint token ranges so that requests never share a prefix by
# accident; tests that want sharing pass `prompt=` explicitly.
_prompt_base = itertools.count(1)

T = TypeVar("T")


def make_request(
    rid: str | None = None,
    prompt_len: int = 8,
    max_tokens: int = 4,
    prompt: list[int] | None = None,
    *,
    eos_token_ids: tuple[int, ...] = (),
    max_model_len: int | None = None,
    **sampling: object,
) -> Request:
    if rid is None:
        rid = f"req-{next(_ids)}"
    if prompt is None:
        base = 10_000 * next(_prompt_base)
        prompt = list(range(base, base + prompt_len))
    params = SamplingParams(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    kwargs: dict[str, object] = {}
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    return Request(rid, list(prompt), params, eos_token_ids, **kwargs)  # type: ignore[arg-type]


# Every scheduler and KV manager the factories made since the last `take_made()` (held until
# then: a test's locals are gone by teardown, when conftest.py's leak check looks at them).
_made: list[Scheduler | KVCacheManager | HybridKVCacheManager] = []


def take_made() -> list[Scheduler | KVCacheManager | HybridKVCacheManager]:
    """The schedulers and KV managers made since the last call."""
    made = list(_made)
    _made.clear()
    return made


def make_kv(
    num_blocks: int = 64, block_size: int = 4, caching: bool = True, window: int | None = None
) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, window=window)
    _made.append(kv)
    return kv


def make_hybrid_kv(
    num_blocks: int = 64,
    sliding_blocks: int = 16,
    block_size: int = 4,
    window: int = 8,
    caching: bool = True,
) -> HybridKVCacheManager:
    """A KV manager with a global group and a sliding one (engine/hybrid_kv.py)."""
    kv = HybridKVCacheManager(num_blocks, sliding_blocks, block_size, window, caching)
    _made.append(kv)
    return kv


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 32,
    max_num_seqs: int = 16,
    chunked: bool = True,
    decode_first: bool = True,
    caching: bool = True,
    prefill_budget: Callable[[int, int, int], int] | None = None,
    window: int | None = None,
) -> Scheduler:
    policy = SchedulerPolicy(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked,
        decode_first=decode_first,
        prefill_budget=prefill_budget,
    )
    scheduler = Scheduler(policy, make_kv(num_blocks, block_size, caching, window))
    _made.append(scheduler)
    return scheduler


def det_token(request: Request) -> int:
    """A token that depends only on (request id, position): equal across schedules."""
    return 100 + zlib.crc32(f"{request.request_id}:{request.num_tokens}".encode()) % 5000


class FakeKVCache:
    """The physical cache as the model would see it: one token id per slot.

    Each step writes the scheduled tokens into their slots, then checks that every scheduled row
    finds its whole context (prefix-cache hits included) in the slots its block table names. This
    catches a block table that points at evicted, reused or wrongly shared blocks. Under a
    sliding window (`window`) the context is what the step's rows see, nothing is written to
    the null block, and a request holds no more blocks than its window and the step span.
    """

    def __init__(self, block_size: int, window: int | None = None, null: int = -1) -> None:
        self.block_size = block_size
        self.window, self.null = window, null
        self.slots: dict[int, int] = {}

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, scheduler: Scheduler, out: SchedulerOutput) -> None:
        for s in out.scheduled:
            end = s.start_pos + s.num_tokens
            assert len(s.block_ids) >= -(-end // self.block_size), s
            real = [b for b in s.block_ids if b != self.null]
            assert len(set(real)) == len(real), s
            for i, tok in enumerate(s.token_ids):
                assert s.block_ids[(s.start_pos + i) // self.block_size] != self.null, s
                self.slots[self._slot(s.block_ids, s.start_pos + i)] = tok
            if self.window is not None:
                span = self.window - 1 + s.num_tokens
                assert len(real) <= -(-span // self.block_size) + 1, s
        for s in out.scheduled:
            req = scheduler.requests[s.request_id]
            first = 0 if self.window is None else max(0, s.start_pos - self.window + 1)
            expected = req.all_token_ids[first : s.start_pos + s.num_tokens]
            got = [
                self.slots.get(self._slot(s.block_ids, p))
                for p in range(first, s.start_pos + s.num_tokens)
            ]
            assert got == expected, f"{s.request_id}: KV content differs from its tokens"


def check_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Invariants of one schedule() result, checked before update_from_output."""
    policy = scheduler.policy
    assert out.num_batched_tokens <= policy.max_num_batched_tokens
    assert len(scheduler.running) <= policy.max_num_seqs
    ids = [s.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    assert not set(ids) & set(out.preempted), "a preempted request was scheduled"
    running = {r.request_id for r in scheduler.running}
    for s in out.scheduled:
        assert s.request_id in running
        req = scheduler.requests[s.request_id]
        assert s.num_tokens >= 1
        assert s.start_pos == req.num_computed_tokens
        assert s.token_ids == req.all_token_ids[s.start_pos : s.start_pos + s.num_tokens]
        assert s.sample == (s.start_pos + s.num_tokens == req.num_tokens)
        assert s.block_ids == scheduler.kv.get_block_ids(s.request_id)
    for r in scheduler.waiting:
        assert r.request_id not in running
        assert not scheduler.kv.has_request(r.request_id), "a waiting request holds blocks"


_fakes: weakref.WeakKeyDictionary[Scheduler, FakeKVCache] = weakref.WeakKeyDictionary()


def fake_cache(scheduler: Scheduler) -> FakeKVCache:
    """The FakeKVCache that follows `scheduler` across `step` and `run_to_completion` calls."""
    if scheduler not in _fakes:
        kv = scheduler.kv
        null = kv.null_block.block_id if kv.null_block is not None else -1
        _fakes[scheduler] = FakeKVCache(kv.block_size, kv.window, null)
    return _fakes[scheduler]


def step(
    scheduler: Scheduler,
    token_fn: Callable[[Request], int] = lambda req: 7,
    check: bool = True,
) -> SchedulerOutput:
    """One engine step: schedule, check invariants and KV content, sample, update."""
    out = scheduler.schedule()
    if check:
        check_step(scheduler, out)
        fake_cache(scheduler).step(scheduler, out)
    sampled = {
        s.request_id: token_fn(scheduler.requests[s.request_id]) for s in out.scheduled if s.sample
    }
    scheduler.update_from_output(out, sampled)
    return out


@dataclass
class RunResult:
    outputs: dict[str, list[int]]  # every request seen, aborted ones included
    steps: list[SchedulerOutput]
    requests: dict[str, Request] = field(default_factory=dict)

    def __iter__(self):  # type: ignore[no-untyped-def]
        """Unpacks as `outputs, steps = run_to_completion(...)`."""
        return iter((self.outputs, self.steps))


def run_to_completion(
    scheduler: Scheduler,
    token_fn: Callable[[Request], int] = lambda req: 7,
    max_steps: int = 1000,
    *,
    before_step: Callable[[int, Scheduler], None] | None = None,
    check: bool = True,
) -> RunResult:
    """Drive the scheduler like the engine does, with fake sampled tokens, until nothing is left.

    `before_step(i, scheduler)` runs before each step and may add or abort requests. Raises
    AssertionError after `max_steps` steps (a livelock).
    """
    seen: dict[str, Request] = dict(scheduler.requests)
    steps: list[SchedulerOutput] = []
    for i in range(max_steps):
        if before_step is not None:
            before_step(i, scheduler)
        seen.update(scheduler.requests)
        if not scheduler.has_unfinished():
            break
        steps.append(step(scheduler, token_fn, check))
    else:
        raise AssertionError(
            f"not finished after {max_steps} steps: {scheduler.num_running} running, "
            f"{scheduler.num_waiting} waiting"
        )
    outputs = {rid: list(r.output_token_ids) for rid, r in seen.items()}
    return RunResult(outputs, steps, seen)


def assert_no_leaks(obj: Scheduler | KVCacheManager | HybridKVCacheManager | BlockPool) -> None:
    """Nothing alive holds memory: all blocks free, no request held, refcounts all 0."""
    if isinstance(obj, Scheduler):
        assert not obj.requests, f"requests still held: {list(obj.requests)}"
        assert not obj.waiting
        assert not obj.running
        assert not obj.held, f"KV still held for transfer: {list(obj.held)}"
        obj = obj.kv
    if isinstance(obj, HybridKVCacheManager):
        for group in obj.groups:
            assert_no_leaks(group)
        assert obj.usage == 0.0
        return
    null = None  # a windowed manager's null block: held for good, by no request
    if isinstance(obj, KVCacheManager):
        assert not obj._blocks, f"block tables still held: {list(obj._blocks)}"
        assert not obj._hashes
        assert not obj._num_cached
        assert obj.num_free_blocks == obj.num_blocks
        assert obj.usage == 0.0
        null = obj.null_block
        assert null is None or (null.ref_cnt == 1 and null.block_hash is None)
        obj = obj.pool
    pool = obj
    others = [b for b in pool.blocks if b is not null]
    assert pool.num_free_blocks == len(others)
    assert all(b.ref_cnt == 0 for b in others), "non-zero reference count"
    assert sorted(pool._free) == [b.block_id for b in others]
    for block_hash, block in pool._cached.items():
        assert block.block_hash == block_hash, "cache map and block disagree"
    for b in pool.blocks:
        if b.block_hash is not None:
            assert pool._cached.get(b.block_hash) is b, "a hashed block missing from the map"


# ---- waiting for something to happen ----------------------------------------------------------
def eventually(
    condition: Callable[[], T], timeout_s: float = 20.0, what: str = "", interval_s: float = 0.01
) -> T:
    """Poll `condition` until it returns something truthy, and return that; after `timeout_s`
    fail naming `what` (and the last value seen). The one way a test waits for another thread
    or process: never a bare sleep that hopes the other side was quick enough."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, (
            f"timed out after {timeout_s:g}s waiting for {what}: {value!r}"
        )
        time.sleep(interval_s)


async def eventually_async(
    condition: Callable[[], T], timeout_s: float = 20.0, what: str = "", interval_s: float = 0.01
) -> T:
    """`eventually` for a test on an event loop: polls without blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, (
            f"timed out after {timeout_s:g}s waiting for {what}: {value!r}"
        )
        await asyncio.sleep(interval_s)


@contextlib.contextmanager
def serving(app: Any, **config: Any) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a free loopback port in a thread; yields its URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", **config))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        eventually(lambda: srv.started, 10, "uvicorn to start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(timeout=5)
        sock.close()


def assert_cluster_idle(cluster: Any) -> None:
    """Leak check for a `LocalCluster`: once its workers settle, none holds a KV block, a
    request, a transfer in either direction, or KV held or reserved for one."""
    for wid, s in cluster.wait_idle().items():
        assert s["kv_blocks_used"] == 0, (wid, s)
        assert s["running"] == 0 and s["waiting"] == 0, (wid, s)
        assert s["transfers_out"] == 0 and s["transfers_in"] == 0, (wid, s)
        assert s.get("held_for_transfer", 0) == 0, (wid, s)
        assert s.get("reserved_for_transfer", 0) == 0, (wid, s)


TINY_VOCAB = 49152  # the SmolLM2 tokenizer's, so tiny models take real text prompts


def assert_engine_idle(llm) -> None:  # type: ignore[no-untyped-def]
    """Leak check for a whole engine: nothing alive, every KV block free."""
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
    assert not eng._live


def greedy_agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    """Share of the reference tokens that come before each pair's first divergence, pooled over
    the pairs (`pdserve bench quant`'s agreement measure)."""
    same = 0
    for a, b in zip(ref, got, strict=True):
        same += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return same / sum(map(len, ref))


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """`preexec_fn` for servers a test starts: the child gets SIGTERM when the pytest process
    that started it dies. A pytest worker OOM-killed mid-test otherwise leaves its `pdserve
    serve` (and that one's workers, which follow their parent) holding GBs for the next run on
    the machine; one such leftover made a later CI run here run out of memory."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def handoff(  # type: ignore[no-untyped-def]
    p, d, prompt: list[int], params: SamplingParams, k: int = 1, rid: str = "r"
) -> list[int]:
    """Prefill (and k-1 decode steps) on LLM p, copy the KV to LLM d, finish on d: the engine half
    of disaggregation without workers or a transport; returns all tokens."""
    pe, de = p.engine, d.engine
    p_params = SamplingParams(**{**params.__dict__, "max_tokens": k})
    rid = pe.add_request(prompt, p_params, rid, hold_kv=True)
    while pe.has_unfinished_requests():
        pe.step()
    held = pe.held_request(rid)
    assert held is not None
    n_kv = held.num_computed_tokens
    assert n_kv == len(prompt) + k - 1
    blocks = de.reserve_kv(prompt, params, rid, n_kv)
    assert blocks is not None
    src = pe.kv_slots(pe.kv_manager.get_block_ids(rid), 0, n_kv)
    dst = de.kv_slots(blocks, 0, n_kv)
    for layer in range(pe.arch.num_layers):
        de.write_kv(dst, layer, *pe.read_kv(src, layer))
    assert pe.release_kv(rid)
    de.admit_prefilled(rid, held.output_token_ids, n_kv)
    out = None
    while de.has_unfinished_requests():
        for o in de.step():
            out = o
    assert out is not None and out.finished
    return out.outputs[0].token_ids


def share_model_conversions(cache: Path) -> None:
    """The default model's converted tokenizer and GGUF index are kept across test runs (and
    shared by the xdist workers and the pytest runs of `make test`) in a folder of their own:
    converting them took each pytest process ~5-15 s of its first test (GGUF header parsing).
    Their entries are keyed by the file's path, size and mtime and the converting library's
    version, so a stale one is never read; the cost models stay per run (fresh folder above).
    Tests of the cache itself point PDSERVE_CACHE_DIR at their own tmp_path; a test that only
    wants its own cost models there calls this on it too."""
    shared = Path(tempfile.gettempdir()) / f"pdserve-tests-model-cache-{os.getuid()}"
    for kind in ("tokenizers", "gguf-index"):
        try:
            (shared / kind).mkdir(parents=True, exist_ok=True)
            if not (cache / kind).exists():
                (cache / kind).symlink_to(shared / kind, target_is_directory=True)
        except OSError:
            pass  # a read-only tmp: each process converts its own, as before
