"""Start workers on this machine: as child processes (`pdserve worker ...`), or as threads of this
process for the `inproc` transport. Used by `LocalCluster` and `pdserve serve`.

A child prints one `PDSERVE_WORKER_READY {json}` line with its endpoints once its model is
loaded; `await_ready` waits for it with a deadline and reports a child that died instead.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from pdserve.config import WorkerConfig, config_argv
from pdserve.workers.worker import READY_PREFIX, Worker


@dataclass(frozen=True)
class WorkerSpec:
    """One worker to start: its role and id, its engine arguments, its process's knobs."""

    role: str
    worker_id: str
    engine_args: dict[str, Any] = field(default_factory=dict)
    config: WorkerConfig = field(default_factory=WorkerConfig)
    # inproc workers only (tests): builds the KV pool instead of the config's --kv-pool-* tiers
    pool_factory: Callable[..., Any] | None = None


@dataclass
class Launched:
    spec: WorkerSpec
    control: str = ""
    kv: str = ""
    proc: subprocess.Popen | None = None
    thread: threading.Thread | None = None
    ready: queue.Queue | None = None


def worker_command(spec: WorkerSpec) -> list[str]:
    """The `pdserve worker` command line that starts `spec` (its config's flags, then the
    engine's, both spelled as `add_config_args` reads them)."""
    cmd = [sys.executable, "-m", "pdserve.cli", "worker", "--role", spec.role]
    cmd += ["--worker-id", spec.worker_id, *config_argv(spec.config)]
    for key, value in spec.engine_args.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(flag if value else "--no-" + key.replace("_", "-"))
        else:  # a mapping (speculative_config from YAML) as the JSON its flag reads
            cmd += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return cmd


def relaunch(w: Launched, ctx: zmq.Context | None = None) -> Launched:
    """Start an exited worker again on the tcp addresses it had, so the sockets connected to
    it (router, peers) reconnect by themselves; the caller awaits readiness."""
    if not w.control.startswith("tcp://"):
        raise ValueError("a restart keeps a worker's tcp addresses: needs the tcp transport")
    port, kv_port = (int(e.rsplit(":", 1)[1]) for e in (w.control, w.kv))
    config = dataclasses.replace(w.spec.config, port=port, kv_port=kv_port)
    return launch(dataclasses.replace(w.spec, config=config), ctx)


def launch(spec: WorkerSpec, ctx: zmq.Context | None = None) -> Launched:
    if spec.pool_factory is not None and spec.config.transport != "inproc":
        raise ValueError("a pool_factory reaches only inproc workers (threads of this process)")
    if spec.config.transport == "inproc":
        return _launch_thread(spec, ctx or zmq.Context.instance())
    # A session of its own: Ctrl-C in a terminal reaches only the parent, which drains and then
    # shuts the workers down; a worker whose parent dies exits by itself (--exit-with-parent).
    cmd = [*worker_command(spec), "--exit-with-parent"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    return Launched(spec, proc=proc)


def _launch_thread(spec: WorkerSpec, ctx: zmq.Context) -> Launched:
    ready: queue.Queue = queue.Queue()

    def main() -> None:
        try:
            w = Worker(
                spec.role,
                spec.engine_args,
                worker_id=spec.worker_id,
                config=spec.config,
                ctx=ctx,
                pool_factory=spec.pool_factory,
            )
        except Exception as e:  # reported to the starting thread, which raises
            ready.put(e)
            return
        ready.put({"control": w.control_endpoint, "kv": w.kv_endpoint})
        w.serve_forever()

    thread = threading.Thread(target=main, name=f"worker-{spec.worker_id}", daemon=True)
    thread.start()
    return Launched(spec, thread=thread, ready=ready)


def await_ready(w: Launched, deadline: float) -> None:
    """Fill in the worker's endpoints; RuntimeError if it dies or the deadline passes."""
    if w.ready is not None:
        got = w.ready.get(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(got, Exception):
            raise RuntimeError(f"worker {w.spec.worker_id} failed to start: {got}") from got
        w.control, w.kv = got["control"], got["kv"]
        return
    assert w.proc is not None and w.proc.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or w.proc.poll() is not None:
            raise RuntimeError(
                f"worker {w.spec.worker_id} did not start (exit code "
                f"{w.proc.poll()}); see its stderr above"
            )
        readable, _, _ = select.select([w.proc.stdout], [], [], min(left, 1.0))
        if readable:
            line = w.proc.stdout.readline()
            if line.startswith(READY_PREFIX):
                info = json.loads(line[len(READY_PREFIX) :])
                w.control, w.kv = info["control"], info["kv"]
                return


def stop(w: Launched, timeout_s: float = 10.0) -> None:
    """Wait for a worker told to shut down; kill a child that does not exit in time."""
    if w.proc is not None:
        try:
            w.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
    if w.thread is not None:
        w.thread.join(timeout=timeout_s)
