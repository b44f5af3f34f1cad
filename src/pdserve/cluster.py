"""`LocalCluster`: real prefill/decode/colocated workers on this machine, driven in-process.

    with LocalCluster(prefill=1, decode=1, transport="tcp") as cluster:
        outs = cluster.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))

Workers are child processes (`pdserve worker ...`), or threads of this process for the `inproc`
transport. The cluster is the requester: it tokenizes, picks P and D round robin, sends ExpectKV to
D and Prefill to P, and assembles the tokens P and D send back into the same `RequestOutput`s as
`LLM.generate`. A failed transfer is retried once (counted in `stats`); a second failure, or a
request silent past its deadline, ends that request with an error — never a hang.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from pdserve.engine import loader
from pdserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pdserve.engine.request import SamplingParams
from pdserve.launcher import Launched, WorkerSpec, await_ready, launch, stop
from pdserve.workers import messages as m

STARTUP_TIMEOUT_S = 180.0


@dataclass
class WorkerHandle:
    launched: Launched
    sock: zmq.Socket | None = None
    info: m.WorkerInfo | None = None

    @property
    def worker_id(self) -> str:
        return self.launched.spec.worker_id

    @property
    def role(self) -> str:
        return self.launched.spec.role


@dataclass
class _Pending:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    pair: tuple[WorkerHandle, WorkerHandle | None]
    last_event: float
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    attempts: int = 1
    first_token_time: float | None = None
    done: bool = False
    arrival: float = field(default_factory=time.monotonic)
    timeline: list[tuple[str, str, float]] = field(default_factory=list)

    @property
    def wire_rid(self) -> str:
        return f"{self.rid}.{self.attempts}"


class LocalCluster:
    def __init__(
        self,
        model: str | None = None,
        prefill: int = 1,
        decode: int = 1,
        colocated: int = 0,
        transport: str = "tcp",
        kv_codec: str = "none",
        *,
        threads: int | None = None,
        handoff_tokens: int = 1,
        deadline_s: float = 5.0,
        lease_s: float = 10.0,
        max_retries: int = 1,
        shm_mb: int = 512,
        stream_kv: bool = True,
        engine_args: dict[str, Any] | None = None,
        prefill_args: dict[str, Any] | None = None,
        decode_args: dict[str, Any] | None = None,
    ) -> None:
        if colocated == 0 and (prefill < 1 or decode < 1):
            raise ValueError("give at least one prefill and one decode worker, or colocated > 0")
        self.model, self.transport, self.kv_codec = model, transport, kv_codec
        self.counts = {"prefill": prefill, "decode": decode, "colocated": colocated}
        n = prefill + decode + colocated
        self.threads = threads or max(1, (os.cpu_count() or 1) // n)
        self.handoff_tokens, self.deadline_s, self.lease_s = handoff_tokens, deadline_s, lease_s
        self.max_retries, self.shm_mb, self.stream_kv = max_retries, shm_mb, stream_kv
        self.engine_args = dict(engine_args or {})
        self.role_args = {
            "prefill": prefill_args or {},
            "decode": decode_args or {},
            "colocated": {},
        }
        self.workers: list[WorkerHandle] = []
        self.ctx = zmq.Context.instance() if transport == "inproc" else zmq.Context()
        self.poller = zmq.Poller()
        self.stats: collections.Counter[str] = collections.Counter()
        self._ids = itertools.count()
        self._rr: dict[str, itertools.cycle] = {}
        self.tokenizer: Any = None

    # ---- life cycle --------------------------------------------------------------------------
    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.tokenizer = loader.load_tokenizer(loader.resolve_model(self.model))
        for role, count in self.counts.items():
            for i in range(count):
                self.workers.append(self._spawn(role, f"{role[0].upper()}{i}"))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for w in self.workers:
            await_ready(w.launched, deadline)
            self._connect(w, deadline)
        for role in self.counts:
            pool = self.pool(role)
            if pool:
                self._rr[role] = itertools.cycle(pool)

    def pool(self, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers if w.role == role]

    def _engine_args(self, role: str) -> dict[str, Any]:
        return {
            "model": self.model,
            "threads": self.threads,
            **self.engine_args,
            **self.role_args[role],
        }

    def _spawn(self, role: str, worker_id: str) -> WorkerHandle:
        spec = WorkerSpec(role, worker_id, self._engine_args(role), self.transport,
                          self.kv_codec, self.deadline_s, self.lease_s, self.shm_mb,
                          self.stream_kv)  # fmt: skip
        return WorkerHandle(launch(spec, self.ctx))

    def _connect(self, w: WorkerHandle, deadline: float) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(w.launched.control)
        w.sock = sock
        self.poller.register(sock, zmq.POLLIN)
        sock.send(m.encode(m.Hello("local-cluster")))
        msg = self._recv_from(w, deadline)
        if not isinstance(msg, m.WorkerInfo):
            raise RuntimeError(f"worker {w.worker_id} answered Hello with {msg!r}")
        w.info = msg

    def _recv_from(self, w: WorkerHandle, deadline: float) -> Any:
        assert w.sock is not None
        if not w.sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
            raise TimeoutError(f"worker {w.worker_id} did not answer")
        return m.decode(w.sock.recv())

    def close(self) -> None:
        for w in self.workers:
            if w.sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    w.sock.send(m.encode(m.Shutdown()), zmq.NOBLOCK)
        for w in self.workers:
            stop(w.launched)
            if w.sock is not None:
                w.sock.close(0)
                w.sock = None
        self.workers = []

    # ---- requests ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | list[int]] | str,
        params: SamplingParams | None = None,
        timeout_s: float | None = None,
    ) -> list[RequestOutput]:
        params = params or SamplingParams()
        batch = [prompts] if isinstance(prompts, str) else list(prompts)
        pending: dict[str, _Pending] = {}
        order = []
        for prompt in batch:
            ids = self._tokenize(prompt)
            rid = f"c{next(self._ids)}"
            order.append(rid)
            pending[rid] = self._dispatch(rid, ids, params)
        self._collect(pending, timeout_s)
        return [self._output(pending[rid], batch[i]) for i, rid in enumerate(order)]

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def _dispatch(
        self, rid: str, ids: list[int], params: SamplingParams, attempts: int = 1
    ) -> _Pending:
        pending = _Pending(rid, ids, params, self._pick(), time.monotonic(), attempts=attempts)
        pending.timeline.append(("dispatch", f"attempt {attempts}", time.monotonic()))
        # Each attempt has its own id on the workers, so a late message about an earlier,
        # failed attempt can never be mistaken for the current one.
        wid, p = pending.wire_rid, dict(params.__dict__)
        first, second = pending.pair
        if second is None:
            self._send(first, m.Generate(wid, ids, p))
            return pending
        assert second.info is not None
        self._send(second, m.ExpectKV(wid, ids, p, first.worker_id, self.handoff_tokens))
        self._send(
            first,
            m.Prefill(wid, ids, p, second.worker_id, second.info.kv_endpoint, self.handoff_tokens),
        )
        return pending

    def _pick(self) -> tuple[WorkerHandle, WorkerHandle | None]:
        if "colocated" in self._rr:
            return next(self._rr["colocated"]), None
        return next(self._rr["prefill"]), next(self._rr["decode"])

    def _send(self, w: WorkerHandle, msg: object) -> None:
        assert w.sock is not None
        w.sock.send(m.encode(msg))

    def _collect(self, pending: dict[str, _Pending], timeout_s: float | None) -> None:
        by_sock = {w.sock: w for w in self.workers}
        silence = timeout_s or max(30.0, 6 * self.deadline_s)
        while not all(p.done for p in pending.values()):
            for sock, _ in self.poller.poll(100):
                while sock.poll(0):
                    self._on_event(pending, by_sock[sock], m.decode(sock.recv()))
            now = time.monotonic()
            for p in pending.values():
                if not p.done and now - p.last_event > silence:
                    self._abort(p)
                    self._finish_error(p, f"no progress for {silence:g}s")

    def _on_event(self, pending: dict[str, _Pending], w: WorkerHandle, msg: Any) -> None:
        rid, _, attempt = str(getattr(msg, "rid", "")).rpartition(".")
        p = pending.get(rid)
        if p is None or p.done or attempt != str(p.attempts):
            return  # unknown, finished, or about an earlier attempt
        p.last_event = time.monotonic()
        if isinstance(msg, m.Tokens):
            self._on_tokens(p, msg)
        elif isinstance(msg, m.TransferReport):
            self.stats[f"kv_{msg.side}_bytes"] += msg.nbytes
            self.stats[f"kv_{msg.side}_frames"] += msg.frames
            for stage, t in (msg.times or {}).items():
                p.timeline.append((f"{msg.side}:{stage}", msg.worker, t))
        elif isinstance(msg, m.RequestFailed):
            self._on_failed(pending, p, msg)

    def _on_tokens(self, p: _Pending, msg: m.Tokens) -> None:
        if not any(e[1] == msg.worker for e in p.timeline if e[0] == "first_token"):
            p.timeline.append(("first_token", msg.worker, msg.time))
        if msg.finished:
            p.timeline.append(("finish", msg.worker, msg.time))
        p.first_token_time = p.first_token_time or time.monotonic()
        p.tokens += msg.token_ids
        p.text += msg.text
        if msg.logprobs:
            p.logprobs = (p.logprobs or []) + msg.logprobs
        if msg.finished:
            p.finish_reason, p.stop_reason, p.done = msg.finish_reason, msg.stop_reason, True
            if p.pair[1] is not None and msg.worker == p.pair[0].worker_id:
                self._send(p.pair[1], m.Abort(p.wire_rid))  # finished on P: D's reservation goes

    def _on_failed(self, pending: dict[str, _Pending], p: _Pending, msg: m.RequestFailed) -> None:
        self._abort(p)
        p.timeline.append((f"failed: {msg.reason}", msg.worker, time.monotonic()))
        if msg.stage == "transfer" and p.attempts <= self.max_retries:
            self.stats["retries"] += 1
            retry = self._dispatch(p.rid, p.prompt_ids, p.params, p.attempts + 1)
            retry.timeline[:0] = p.timeline  # the retry is part of the request's story
            retry.arrival = p.arrival
            pending[p.rid] = retry
            return
        self._finish_error(p, f"{msg.worker} ({msg.stage}): {msg.reason}")

    def _abort(self, p: _Pending) -> None:
        for w in p.pair:
            if w is not None:
                self._send(w, m.Abort(p.wire_rid))

    def _finish_error(self, p: _Pending, reason: str) -> None:
        self.stats["errors"] += 1
        p.error, p.finish_reason, p.done = reason, "error", True

    def _output(self, p: _Pending, prompt: str | list[int]) -> RequestOutput:
        completion = CompletionOutput(
            0, p.text, p.tokens, p.logprobs, p.finish_reason, p.stop_reason
        )
        metrics = RequestMetrics(
            arrival_time=p.arrival,
            first_token_time=p.first_token_time,
            finished_time=time.monotonic(),
        )
        return RequestOutput(
            p.rid,
            prompt if isinstance(prompt, str) else None,
            p.prompt_ids,
            [completion],
            True,
            metrics,
            error=p.error,
            timeline=sorted(p.timeline, key=lambda e: e[2]),
        )

    # ---- introspection and faults ------------------------------------------------------------
    def worker_stats(self) -> dict[str, dict[str, Any]]:
        out = {}
        for w in self.workers:
            self._send(w, m.GetStats())
            msg = self._recv_until(w, m.Stats)
            out[w.worker_id] = msg.stats
        return out

    def _recv_until(self, w: WorkerHandle, kind: type) -> Any:
        deadline = time.monotonic() + 10
        while True:
            msg = self._recv_from(w, deadline)
            if isinstance(msg, kind):
                return msg

    def set_fault(self, worker_id: str, mode: str, count: int = 1, delay_s: float = 0.0) -> None:
        w = next(w for w in self.workers if w.worker_id == worker_id)
        self._send(w, m.SetFault(mode, count, delay_s))

    def wait_idle(self, timeout_s: float = 15.0) -> dict[str, dict[str, Any]]:
        """Poll until every worker holds no KV and no transfer; returns the last stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.worker_stats()
            if (
                all(
                    s["kv_blocks_used"] == 0
                    and s["transfers_out"] == 0
                    and s["transfers_in"] == 0
                    and s["running"] == 0
                    and s["waiting"] == 0
                    for s in stats.values()
                )
                or time.monotonic() > deadline
            ):
                return stats
            time.sleep(0.1)
