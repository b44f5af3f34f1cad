"""Control-message authentication: HMAC tags, the shared secret, and refusing to run exposed
without one; end to end, a cluster whose workers share a secret serves, and an untagged message
to a worker is rejected."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from pdserve import LLM, SamplingParams
from pdserve.cluster import LocalCluster
from pdserve.workers import auth
from pdserve.workers import messages as m

SECRET = b"correct horse battery staple"


@pytest.fixture
def keyed() -> Iterator[None]:
    m.set_key(SECRET)
    yield
    m.set_key(None)


def test_tagged_round_trip_and_every_tamper_is_rejected(keyed) -> None:  # type: ignore[no-untyped-def]
    msg = m.Generate("r1", [1, 2, 3], {"max_tokens": 4})
    data = m.encode(msg)
    m.set_key(None)
    assert len(data) == len(m.encode(msg)) + m.TAG_BYTES  # the body, then the tag
    m.set_key(SECRET)
    assert m.decode(data) == msg
    for bad in (
        data[: -m.TAG_BYTES],  # no tag
        data[:-1] + bytes([data[-1] ^ 1]),  # tag changed
        bytes([data[0] ^ 1]) + data[1:],  # body changed
        b"",
        data[-m.TAG_BYTES :],  # tag only
    ):
        with pytest.raises(m.MessageError, match="unauthenticated"):
            m.decode(bad)
    m.set_key(b"another secret of enough length")
    with pytest.raises(m.MessageError, match="unauthenticated"):
        m.decode(data)


def test_without_a_key_a_tagged_message_does_not_parse() -> None:
    m.set_key(SECRET)
    data = m.encode(m.Abort("r"))
    m.set_key(None)
    with pytest.raises(m.MessageError):
        m.decode(data)
    assert m.decode(m.encode(m.Abort("r"))) == m.Abort("r")


def test_load_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.ENV, raising=False)
    assert auth.load_secret() is None
    monkeypatch.setenv(auth.ENV, "s" * 20)
    assert auth.load_secret() == b"s" * 20
    f = tmp_path / "secret"
    f.write_bytes(b"\x00\xff" * 10 + b"\n")
    assert auth.load_secret(f) == b"\x00\xff" * 10  # file wins; bytes, trailing newline dropped
    f.write_text("short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        auth.load_secret(f)
    with pytest.raises(ValueError, match="cannot read"):
        auth.load_secret(tmp_path / "missing")


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("localhost", True),
     ("tcp://127.0.0.1:5555", True), ("ipc:///tmp/x", True), ("inproc://a", True),
     ("0.0.0.0", False), ("10.1.2.3", False), ("tcp://10.1.2.3:5555", False),
     ("tcp://[::1]:80", True), ("example.com", False)],
)  # fmt: skip
def test_is_loopback(address: str, loopback: bool) -> None:
    assert auth.is_loopback(address) is loopback


def test_require_secret() -> None:
    auth.require_secret(["127.0.0.1", "tcp://127.0.0.1:9"], None)
    auth.require_secret(["10.0.0.2"], SECRET)
    with pytest.raises(ValueError, match=r"10\.0\.0\.2 is not loopback"):
        auth.require_secret(["127.0.0.1", "10.0.0.2"], None)


def test_worker_refuses_a_network_address_without_a_secret() -> None:
    env = {k: v for k, v in os.environ.items() if k != auth.ENV}
    cmd = [sys.executable, "-m", "pdserve.cli", "worker", "--role", "prefill", "--host", "0.0.0.0"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "PDSERVE_SECRET" in proc.stderr and "not loopback" in proc.stderr


def test_cluster_with_a_shared_secret_serves_and_rejects_untagged(
    tiny_llama_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = LLM(str(tiny_llama_path)).generate(["Hello there"], params)[0].outputs[0].token_ids
    monkeypatch.setenv(auth.ENV, SECRET.decode())
    try:
        with LocalCluster(str(tiny_llama_path), transport="tcp", threads=1) as c:
            (out,) = c.generate(["Hello there"], params)
            assert out.error is None and out.outputs[0].token_ids == want
            # a peer without the secret: its message is refused, nothing else happens
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(c.workers[0].launched.control)
            sock.send(msgpack.packb({"v": 1, "t": "Shutdown"}))
            assert sock.poll(10_000)
            reply = m.decode(sock.recv())  # the worker's answer is tagged with the secret
            sock.close()
            assert isinstance(reply, m.RequestFailed) and "unauthenticated" in reply.reason
            assert c.worker_stats()[c.workers[0].worker_id]["bad_messages"] == 1
            (again,) = c.generate(["Hello there"], params)  # still serving: no Shutdown
            assert again.outputs[0].token_ids == want
    finally:
        m.set_key(None)
