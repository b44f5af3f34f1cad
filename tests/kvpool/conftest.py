"""A real redis-server on a random loopback port for the pool's Redis tier, started here and
stopped afterwards. `make test` installs Debian's redis-server when missing; without it these
tests FAIL (never skip silently) unless PDSERVE_TEST_SKIP_REDIS=1 says to skip them knowingly."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

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
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.kill()
    shutil.rmtree(server.workdir, ignore_errors=True)


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The shared server, emptied for this test."""
    redis_server.flush()
    return redis_server.url


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A server of this test's own, for killing and restarting."""
    server = RedisServer()
    server.start()
    yield server
    server.kill()
    shutil.rmtree(server.workdir, ignore_errors=True)
