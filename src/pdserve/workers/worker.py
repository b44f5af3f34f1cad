"""A worker process: one engine, a control socket, a KV socket, one main loop.

Roles (`prefill`, `decode`, `colocated`) only say what a router should send here; every worker
can run whole requests (`Generate`), prefill for another worker (`Prefill`, see prefill.py) and
receive KV (`ExpectKV`, see decode.py). The loop never blocks: it polls the sockets (briefly
when idle, not at all when the engine has work), runs one engine step, sends the new tokens to
whoever asked, and checks every deadline.

Sockets: control = ROUTER (clients connect DEALERs, typed msgpack messages both ways). The KV
link (transfer/api.py, over the `--transport` named) has two ends here: a receiver, where prefill
workers push frames (decode.py), and a sender to the decode workers we push to (prefill.py); both
wake the loop through its poller.

Prefix-cache events: every client that says Hello subscribes. It gets WorkerInfo, then a
snapshot (KVEvents with `cleared=True`: every block hash cached here), then after each loop turn
that changed the cache one KVEvents with the hashes stored and removed. `seq` counts the messages
sent to that subscriber from 0 (the snapshot), so a gap tells it to resync: Hello again.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from pdserve.config import EngineConfig, WorkerConfig, add_config_args, config_from_args
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.transfer.api import LinkSetup
from pdserve.transfer.codecs import get_codec
from pdserve.transfer.transports import get_transport
from pdserve.workers import auth
from pdserve.workers import messages as m
from pdserve.workers import pool as kvpool
from pdserve.workers.context import HandoffSettings, WorkerContext
from pdserve.workers.decode import DecodeSide
from pdserve.workers.faults import slow_layers
from pdserve.workers.gc_pauses import GcPauses
from pdserve.workers.heartbeat import Heartbeat
from pdserve.workers.prefill import PrefillSide

ROLES = ("prefill", "decode", "colocated")
# The weight formats each role's engine holds (ModelConfig.phases). A worker whose role the
# router switches later keeps what it loaded: a P turned D decodes on the prefill format.
ROLE_PHASES = {"prefill": "prefill", "decode": "decode", "colocated": "both"}
READY_PREFIX = "PDSERVE_WORKER_READY "
MAX_SUBSCRIBERS = 32  # clients getting KVEvents; the longest-subscribed is dropped past this
MAX_THREADS = 1024  # a SetThreads beyond this is a bug or an attack, not a big host
EVENT_CHUNK = 50_000  # block hashes per KVEvents (~1.7 MB), far below MAX_MESSAGE_BYTES


class Worker:
    def __init__(
        self,
        role: str,
        engine_args: dict[str, Any],
        *,
        worker_id: str | None = None,
        config: WorkerConfig | None = None,
        ctx: zmq.Context | None = None,
        pool_factory: kvpool.PoolFactory | None = None,
    ) -> None:
        """`pool_factory`: builds the KV pool instead of the `--kv-pool-*` flags' tiers (tests
        share one in-process pool between inproc workers)."""
        self.config = cfg = config or WorkerConfig()
        host, port, transport = cfg.host, cfg.port, cfg.transport
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        get_codec(cfg.kv_codec)
        link = get_transport(transport)
        self.role = role
        self.worker_id = worker_id or f"{role[0].upper()}-{os.getpid()}"
        self.log = logging.getLogger(f"pdserve.worker.{self.worker_id}")
        # A P worker holds the prefill format, a D worker the decode one (prefill_format.py).
        engine_config = EngineConfig.from_kwargs(**{"phases": ROLE_PHASES[role], **engine_args})
        budget = stall_free_budget(engine_config, cfg.slo_tpot_s, cfg.cost_model)
        self.engine = LLMEngine(engine_config, budget)
        self.fingerprint, self.kv_desc = kvpool.kv_fingerprint(self.engine)
        self.kv_pool = kvpool.attach(self.engine, cfg, pool_factory)
        self.kv_pools = (
            kvpool.pool_ids(cfg, self.engine.pool_link.namespace, self.worker_id)
            if self.kv_pool and self.engine.pool_link
            else []
        )
        self.ctx = ctx or zmq.Context.instance()
        self.control = self.ctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        inproc = transport == "inproc"
        ctl_endpoint = f"inproc://ctl-{self.worker_id}" if inproc else f"tcp://{host}:{port or '*'}"
        self.control.bind(ctl_endpoint)
        self.control_endpoint = self.control.getsockopt_string(zmq.LAST_ENDPOINT)
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        self.clients: dict[str, bytes] = {}  # request id -> identity of who asked
        self.subscribers: dict[bytes, int] = {}  # KVEvents subscriber -> next seq it gets
        self.counters: collections.Counter[str] = collections.Counter()
        setup = LinkSetup(
            self.worker_id, host, cfg.kv_port, cfg.shm_mb << 20, self.counters, self.poller,
            self.ctx,
        )  # fmt: skip
        kv_in = link.receiver(setup)
        self.kv_endpoint = kv_in.endpoint
        settings = HandoffSettings.of(cfg, self.fingerprint)
        sides = WorkerContext(
            self.worker_id, self.engine, settings, self.emit, self.clients, self.counters, self.log
        )
        self.prefill = PrefillSide(sides, link.sender(setup))
        self.decode = DecodeSide(sides, kv_in)
        self.running = True
        self.parent_pid: int | None = None  # exit when this process is no longer our parent
        self.loop_at = time.monotonic()  # when the main loop last turned (heartbeats report it)
        self.slow_steps, self.slow_s = 0, 0.0  # fault injection: sleep before engine steps
        self.held = False  # SetThreads(0): no engine step until a count above 0
        hb_endpoint = f"inproc://hb-{self.worker_id}" if inproc else f"tcp://{host}:*"
        self.loop_thread: int | None = None  # the thread serving the main loop (serve_forever)
        model = getattr(self.engine, "model", None)
        self.heartbeat = Heartbeat(
            self.ctx, hb_endpoint, self.worker_id, lambda: self.loop_at, lambda: self.loop_thread,
            work_tick=None if model is None else lambda: getattr(model, "layer_done_at", 0.0),
        )  # fmt: skip
        # Every collection in this process, timed (gc_pauses.py): a full one stalls the loop.
        self.gc_pauses = GcPauses().install()

    # ---- main loop ---------------------------------------------------------------------------
    def serve_forever(self) -> None:
        self.loop_thread = threading.get_ident()
        try:
            while self.running:
                self.run_once()
        finally:
            self.close()

    def run_once(self) -> None:
        self.loop_at = time.monotonic()
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            self.log.warning("parent process %d is gone; shutting down", self.parent_pid)
            self.running = False
            return
        busy = self.engine.has_unfinished_requests() and not self.held
        if self.control in dict(self.poller.poll(0 if busy else 5)):
            self._drain_control()
        self.decode.poll()  # frames and messages from prefill workers
        self.prefill.poll()  # replies from decode workers
        if self.engine.has_unfinished_requests() and not self.held:
            self._maybe_slow()
            ended = [out.request_id for out in self.engine.step() if self._on_output(out)]
            for rid in ended:  # after the whole step: n choices may end in the same one
                if self.engine.is_done(rid):
                    self.clients.pop(rid, None)
            # what peers sent during the step counts before deadlines are judged (a D in one 5 s
            # prefill step failed a hand-off whose frames sat in its socket; the router redid it)
            self.decode.poll()
            self.prefill.poll()
        self.prefill.run_deferred()
        now = time.monotonic()
        self.prefill.flush_delayed()
        self.prefill.check_deadlines(now)
        self.decode.check_deadlines(now)
        self.engine.kv_manager.expire_kept()
        if self.engine.has_kv_events:  # one attribute check per turn when nothing changed
            self.publish_kv_events()

    def _drain_control(self) -> None:
        while True:
            try:
                parts = self.control.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_control(parts[0].bytes, parts[1:])

    # ---- control socket ----------------------------------------------------------------------
    def _on_control(self, client: bytes, parts: list) -> None:
        try:
            if len(parts) != 1:
                raise m.MessageError("expected a single-part message")
            msg = m.decode(parts[0].buffer)
        except ValueError as e:
            self.counters["bad_messages"] += 1
            self._send(client, m.RequestFailed("", self.worker_id, str(e), "admission"))
            return
        try:
            self._handle(client, msg)
        except Exception as e:  # the client learns why; the worker keeps serving
            rid = getattr(msg, "rid", "")
            if not isinstance(e, ValueError):
                self.counters["internal_errors"] += 1
                self.log.exception("error handling %s", type(msg).__name__)
            if rid and not isinstance(e, ValueError):
                self.abort(rid)  # leave nothing half-admitted behind an unexpected error
            self.clients.pop(rid, None)
            self._send(client, m.RequestFailed(rid, self.worker_id, str(e), "admission"))

    def _handle(self, client: bytes, msg: object) -> None:
        if isinstance(msg, m.Hello):
            self._send(client, self.info())
            if msg.subscribe:
                self.subscribe(client)
        elif isinstance(msg, m.Generate):
            self.engine.add_request(msg.prompt_ids, m.sampling_params(msg.params), msg.rid)
            if msg.conversation:
                self.engine.mark_turn(msg.rid, msg.conversation)
            self.clients[msg.rid] = client
        elif isinstance(msg, m.Prefill):
            self.prefill.start(msg, client)
        elif isinstance(msg, m.ExpectKV):
            self.decode.expect(msg, client)
        elif isinstance(msg, m.Abort):
            self.abort(msg.rid)
        elif isinstance(msg, m.GetStats):
            self._send(client, m.Stats(self.stats()))
        elif isinstance(msg, m.GetSteps):
            self._send(client, m.Steps(self.worker_id, *self.engine.step_log.wire_since(msg.since)))
        elif isinstance(msg, m.SetFault):
            self.set_fault(msg)
        elif isinstance(msg, m.SetRole):
            if msg.role not in ROLES:
                raise ValueError(f"role must be one of {', '.join(ROLES)}, got {msg.role!r}")
            self.log.info("role %s -> %s", self.role, msg.role)
            self.role = msg.role
            self.counters["role_switches"] += 1
            self._send(client, self.info())
        elif isinstance(msg, m.SetThreads):
            self.set_threads(msg.threads, msg.step_tokens)
            self._send(client, m.Stats(self.stats()))
        elif isinstance(msg, m.Shutdown):
            self.running = False
        else:
            raise m.MessageError(f"{type(msg).__name__} is not a request to a worker")

    def _maybe_slow(self) -> None:
        if self.slow_steps:
            self.slow_steps -= 1 if self.slow_steps > 0 else 0  # -1: every step
            time.sleep(self.slow_s)

    def set_threads(self, n: int, step_tokens: int = 0) -> None:
        """Applied between engine steps: one in progress (a prefill chunk too) ends on the old
        count. Our kernels read at::get_num_threads per call: nothing caches it. 0 holds the
        steps (`hold_decode`: KV still arrives, messages are answered) until a count above 0;
        `step_tokens` caps the engine's steps from the next on (0: its own budget)."""
        if not (0 <= n <= MAX_THREADS and step_tokens >= 0):
            raise ValueError(f"threads must be in 0..{MAX_THREADS}, got {n} ({step_tokens=})")
        self.engine.scheduler.step_tokens = step_tokens or None
        if (n == 0) != self.held:
            self.held = n == 0
            self.counters["step_holds" if self.held else "step_resumes"] += 1
        # held, it still stores arriving KV: on one thread, whose team cannot spin on P's cores
        if max(1, n) != torch.get_num_threads():
            torch.set_num_threads(max(1, n))
            self.counters["thread_changes"] += 1

    def set_fault(self, msg: m.SetFault) -> None:
        """Frame faults (drop, delay, corrupt) on what this worker sends as P; lost acks as D;
        slow engine steps (a worker that is alive but slow)."""
        if msg.mode not in ("none", "drop", "delay", "corrupt", "drop_ack", "slow", "slow_layers"):
            raise ValueError(f"unknown fault mode {msg.mode!r}")
        if msg.mode in ("slow_layers", "none"):  # a long step that makes progress, until none
            delay = max(0.0, msg.delay_s) if msg.mode != "none" else 0.0
            slow_layers(getattr(self.engine, "model", None), delay)
            if msg.mode != "none":
                return
        if msg.mode == "drop_ack":
            self.decode.drop_acks = msg.count
            return
        if msg.mode == "slow":
            if msg.delay_s < 0:
                raise ValueError("slow needs delay_s >= 0")
            self.slow_steps, self.slow_s = msg.count, msg.delay_s
            return
        if msg.mode == "none":
            self.slow_steps, self.decode.drop_acks = 0, 0
        self.prefill.fault.mode, self.prefill.fault.remaining = msg.mode, msg.count
        self.prefill.fault.delay_s = msg.delay_s

    def info(self) -> m.WorkerInfo:
        e = self.engine
        return m.WorkerInfo(
            self.worker_id,
            self.role,
            os.getpid(),
            self.kv_endpoint,
            e.cache.block_size,
            e.kv_manager.num_blocks,
            self.fingerprint,
            str(e.source.path),
            self.heartbeat.endpoint,
            list(self.kv_pools),
            self.kv_desc,
        )

    # ---- prefix-cache events -----------------------------------------------------------------
    def subscribe(self, client: bytes) -> None:
        """(Re)subscribe `client`: a snapshot of the cache with seq 0, then the changes."""
        self.subscribers.pop(client, None)
        if self.engine.has_kv_events:
            self.publish_kv_events()  # others get what changed; the snapshot already holds it
        if len(self.subscribers) >= MAX_SUBSCRIBERS:
            del self.subscribers[next(iter(self.subscribers))]
        self.subscribers[client] = 0
        self._send_kv_events(client, self.engine.cached_block_hashes(), [], cleared=True)

    def publish_kv_events(self) -> None:
        """Send what the prefix cache stored and removed since the last call to every
        subscriber (never blocking: a subscriber that is gone just misses them)."""
        stored, removed, cleared = self.engine.take_kv_events()
        for client in list(self.subscribers):
            self._send_kv_events(client, stored, removed, cleared)

    def _send_kv_events(
        self, client: bytes, stored: list[bytes], removed: list[bytes], cleared: bool
    ) -> None:
        """One KVEvents, or several of at most EVENT_CHUNK hashes (only the first `cleared`)."""
        n = EVENT_CHUNK
        chunks: list[tuple[list[bytes], list[bytes]]]
        chunks = [(stored[i : i + n], []) for i in range(0, len(stored), n)]
        chunks += [([], removed[i : i + n]) for i in range(0, len(removed), n)]
        for i, (part_s, part_r) in enumerate(chunks or [([], [])]):
            seq = self.subscribers[client]
            self.subscribers[client] = seq + 1
            msg = m.KVEvents(
                self.worker_id,
                seq,
                self.engine.cache.block_size,
                part_s,
                part_r,
                cleared and i == 0,
            )
            self._send(client, msg)

    def abort(self, rid: str) -> None:
        self.prefill.abort(rid)
        self.decode.abort(rid)
        self.engine.abort_request(rid)
        self.clients.pop(rid, None)

    # ---- outputs -----------------------------------------------------------------------------
    def _on_output(self, out: RequestOutput) -> bool:
        """Emit the output; True when this choice ended here for good (not a hand-off)."""
        c = out.outputs[0]
        handoff = out.finished and self._is_handoff(out)
        self.emit(
            out.request_id,
            m.Tokens(
                out.request_id,
                self.worker_id,
                out.new_token_ids,
                out.new_text,
                finished=out.finished and not handoff,
                finish_reason=None if handoff else c.finish_reason,
                stop_reason=None if handoff else c.stop_reason,
                logprobs=c.logprobs[-len(out.new_token_ids) :] if c.logprobs else None,
                handoff=handoff,
                time=time.monotonic(),
                times=_stage_times(out) if out.finished else None,
                index=c.index,
                pool=out.kv_pool,
                spec=_spec_fields(out) if out.finished else None,
                cached=out.metrics.num_cached_tokens if out.finished and out.metrics else -1,
            ),
        )
        if out.finished and c.index == 0:
            self.prefill.on_finished(out.request_id, handoff, _stage_times(out))
        return out.finished and not handoff

    def _is_handoff(self, out: RequestOutput) -> bool:
        """Finished only because P's run stops at the hand-off, not for the client's reasons."""
        o = self.prefill.out.get(out.request_id)
        c = out.outputs[0]
        # n > 1: D decides every choice's end (choice 0 may stop here while others go on)
        if o is None or (c.finish_reason != "length" and o.params.n == 1):
            return False
        n = len(out.prompt_token_ids) + len(c.token_ids)
        return len(c.token_ids) < o.params.max_tokens and n < self.engine.max_model_len

    def emit(self, rid: str, msg: object) -> None:
        client = self.clients.get(rid)
        if client is not None:
            self._send(client, msg)

    def _send(self, client: bytes, msg: object) -> None:
        try:
            self.control.send_multipart([client, m.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self.log.warning("cannot reach client %r: %s", client, e)

    def stats(self) -> dict[str, Any]:
        return {
            **self.engine.stats(),
            **self.counters,
            **self.gc_pauses.stats(),
            "worker_id": self.worker_id,
            "role": self.role,
            "transfers_out": len(self.prefill.out),
            "transfers_in": len(self.decode.inc),
            "kv_event_subscribers": len(self.subscribers),
            "threads": 0 if self.held else torch.get_num_threads(),
        }

    def close(self) -> None:
        self.gc_pauses.close()
        if self.kv_pool is not None:
            self.kv_pool.close()
        self.heartbeat.close()
        self.prefill.close()
        self.decode.close()
        self.control.close(0)


def _spec_fields(out: RequestOutput) -> dict[str, int] | None:
    m_ = out.metrics
    if m_ is None or not m_.spec_steps:
        return None
    return {
        "draft_tokens": m_.spec_draft_tokens,
        "accepted_tokens": m_.spec_accepted_tokens,
        "steps": m_.spec_steps,
    }


def _stage_times(out: RequestOutput) -> dict[str, float]:
    m_ = out.metrics
    if m_ is None:
        return {}
    stamps = {"prefill_start": m_.first_scheduled_time, "first_token": m_.first_token_time}
    return {k: v for k, v in stamps.items() if v is not None}


def stall_free_budget(
    config: EngineConfig, slo_tpot_s: float | None, cost_model: str | None
) -> Callable[[int, int, int], int] | None:
    """With a TPOT SLO, each step's prompt tokens are sized to keep running decodes within it
    (stall-free batching); the time per token comes from the cost model file."""
    if slo_tpot_s is None:
        return None
    if cost_model is None:
        raise ValueError("--slo-tpot on a worker needs --cost-model (pdserve bench profile)")
    from pathlib import Path

    from pdserve.costmodel.model import CostModel
    from pdserve.engine.step_budget import tpot_prefill_budget

    cost = CostModel.load(Path(cost_model))
    max_tokens = config.scheduler_config.max_num_batched_tokens
    return tpot_prefill_budget(cost, slo_tpot_s, max_tokens)


# ---- process entry point ---------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--worker-id", default=None)
    add_config_args(parser, WorkerConfig)
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="shut down when the process that started this worker exits",
    )
    parser.add_argument(
        "--secret-file",
        default=None,
        help="shared secret authenticating control messages (else $PDSERVE_SECRET); required "
        "off loopback",
    )


def run(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    secret = auth.load_secret(args.secret_file)
    auth.require_secret([args.host], secret)  # before loading a model: fail fast
    m.set_key(secret)
    config = config_from_args(WorkerConfig, args)
    worker = Worker(args.role, engine_args, worker_id=args.worker_id, config=config)
    if args.exit_with_parent:
        worker.parent_pid = os.getppid()
    worker.gc_pauses.freeze_startup_heap()  # the model and tokenizer live as long as we do
    ready = {
        "worker_id": worker.worker_id,
        "role": worker.role,
        "pid": os.getpid(),
        "control": worker.control_endpoint,
        "kv": worker.kv_endpoint,
    }
    print(READY_PREFIX + json.dumps(ready), flush=True)
    worker.serve_forever()
    return 0
