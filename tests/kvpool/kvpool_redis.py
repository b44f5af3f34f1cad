"""A real redis-server on a random loopback port (tests/kvpool/conftest.py starts and stops it)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import pytest

from factories import die_with_parent

SKIP_ENV = "PDSERVE_TEST_SKIP_REDIS"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    """One redis-server process on loopback; `kill()` and `start()` again to test outages."""

    port: int = field(default_factory=_free_port)
    maxmemory: str = "64mb"
    proc: subprocess.Popen[bytes] | None = None
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="pdserve-redis-"))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            if os.environ.get(SKIP_ENV) == "1":
                pytest.skip(f"redis-server missing and {SKIP_ENV}=1")
            pytest.fail(
                "redis-server is not installed: `make test` installs it "
                f"(apt-get install redis-server); or set {SKIP_ENV}=1 to skip knowingly"
            )
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--maxmemory", self.maxmemory,
                "--maxmemory-policy", "allkeys-lru", "--dir", self.workdir]  # fmt: skip
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 10.0) -> None:
        import redis

        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        end = time.monotonic() + timeout
        try:
            while True:
                assert self.proc is not None and self.proc.poll() is None, "redis-server died"
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if time.monotonic() > end:
                        raise
                    time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def flush(self) -> None:
        import redis

        with redis.Redis(port=self.port) as client:
            client.flushall()
