"""A real redis-server on a random loopback port for the pool's Redis tier, started here and
stopped afterwards. `make test` installs Debian's redis-server when missing; without it these
tests FAIL (never skip silently) unless PDSERVE_TEST_SKIP_REDIS=1 says to skip them knowingly."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from kvpool_redis import RedisServer


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
