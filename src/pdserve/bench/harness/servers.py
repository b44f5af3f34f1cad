"""A server under test and the load against it: start a server (pdserve or a peer) on a free
port, wait until it serves, stop it and every process it started; run a `bench/load/` load
(`serve_bench`: the client, its result dict) against its URL; fetch pdserve's per-request
timelines, and the workers' engine steps over it (GET /admin/steps), after the load.

A server is anything `Launchable`: a name, the command line for a port, and optionally extra
environment (`peers.System` for `bench compare`, `Server` for the benches that only start
pdserve). The KV-pool benches also start a throw-away `redis_server`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from pdserve.bench.load import serve_bench

if TYPE_CHECKING:
    from pdserve.workloads.spec import LoadSpec
    from pdserve.workloads.streams import Workload

Command = Callable[[argparse.Namespace, int], list[str]]  # (the bench's flags, port) -> argv
Env = Callable[[argparse.Namespace], dict[str, str]]


class Launchable(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def command(self) -> Command: ...

    @property
    def env(self) -> Env | None: ...


@dataclass
class Server:
    """A server that needs nothing but its command line (pdserve itself)."""

    name: str
    command: Command
    env: Env | None = None


def pdserve_bin() -> str:
    """The `pdserve` script next to this interpreter (the checkout under test)."""
    return str(Path(sys.executable).with_name("pdserve"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


@contextlib.contextmanager
def running_server(system: Launchable, args: argparse.Namespace, log_path: Path) -> Iterator[str]:
    """Start `system` on a free port, yield its base URL once /v1/models answers, stop it.

    `args` needs `startup_timeout` (s); the server's output goes to `log_path`, whose tail is
    in the error when the server exits or is not ready in time."""
    port = free_port()
    cmd = system.command(args, port)
    env = dict(os.environ, **(system.env(args) if system.env else {}))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _await_ready(proc, url, args.startup_timeout, log_path)
        yield url
    finally:
        _stop(proc)


def _await_ready(proc: subprocess.Popen[bytes], url: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout:g}s:\n{log_tail(log)}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    # children that outlived the server (vLLM's engine core, its workers) would hold cores and
    # memory into the next phase (its own session: the group is the server's alone)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def redis_server(maxmemory: str = "2gb") -> Iterator[str]:
    """A throw-away redis-server on a free loopback port (no persistence, LRU at `maxmemory`):
    yields its URL, kills it and removes its folder after. FileNotFoundError when
    redis-server is not installed (`make redis`)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server is not installed (make redis)")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="pdserve-bench-redis-")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru", "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def wait_healthy(url: str, timeout: float) -> bool:
    """Until GET /health says "ok" (True), or `timeout` passed (False: run anyway)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            resp = httpx.get(f"{url}/health", timeout=2.0)
            if resp.status_code == 200 and resp.json().get("status") == "ok":
                return True
        time.sleep(0.5)
    return False


def run_load(spec: LoadSpec, workload: Workload | None = None) -> dict[str, Any]:
    """One `bench serve` load (`spec`; `workload`: these items instead of the spec's) to its
    end: the result dict of `bench/load/summary.py`."""
    return asyncio.run(serve_bench.run_benchmark(spec, workload))


async def fetch_timelines(url: str, records: list[dict[str, Any]]) -> int:
    """Attach each answered request's timeline events and cost-model prediction (pdserve's
    GET /v1/requests/{id}/timeline, when it has them); returns how many it attached."""
    n = 0
    async with httpx.AsyncClient(timeout=10.0) as client:
        for rec in records:
            rid = rec.get("response_id")
            if not rid:
                continue
            with contextlib.suppress(httpx.HTTPError, ValueError):
                resp = await client.get(f"{url}/v1/requests/{rid}/timeline")
                if resp.status_code == 200:
                    body = resp.json()
                    rec["timeline"] = body.get("events")
                    rec["prediction"] = body.get("prediction")
                    if body.get("speculation"):  # drafted / accepted tokens, steps
                        rec["speculation"] = body["speculation"]
                    n += 1
    return n


def fetch_steps(url: str, since: float) -> dict[str, Any]:
    """pdserve's workers' engine steps begun at or after `since` (time.monotonic(), one clock
    on this host: the server runs here), as GET /admin/steps answers; {"error": why} when the
    server cannot say (a loaded sweep point is kept whatever this returns)."""
    try:
        resp = httpx.get(f"{url}/admin/steps", params={"since": since}, timeout=30.0)
        resp.raise_for_status()
        body = resp.json()
    except (httpx.HTTPError, ValueError) as e:
        return {"error": str(e) or type(e).__name__}
    return body if isinstance(body, dict) else {"error": f"not an object: {body!r:.80}"}
