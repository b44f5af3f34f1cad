"""Workers joining and leaving a running router (RouterCore.add_worker / drain_worker /
remove_worker, against fake workers), and the /admin/pools routes (router/pools.py) with a fake
scaler and without one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import zmq.asyncio
from fake_core import FakeCore
from fake_workers import FakeWorker, start_fakes
from fastapi.testclient import TestClient

from pdserve.costmodel.model import CostModel
from pdserve.engine.request import SamplingParams
from pdserve.router.app import create_app
from pdserve.router.core import RequestError, RouterCore

MODEL = CostModel((0.0, 2e-4, 0.0), (0.005, 0.0005, 0.0), (0.0, 1e12))
PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


async def tokens(core: RouterCore, rid: str, prompt: list[int]) -> list[int]:
    return [t async for d in core.generate(rid, prompt, PARAMS) for t in d.token_ids]


async def with_core(body: Any) -> Any:
    ctx = zmq.asyncio.Context()
    fakes = await start_fakes(ctx, MODEL, {"P0": "prefill", "D0": "decode"})
    core = RouterCore(
        [f.endpoint for f in fakes], ctx=ctx, stats_interval_s=0.2, policy="round_robin"
    )
    await core.start(timeout_s=5)
    try:
        return await body(core, ctx, fakes)
    finally:
        await core.close()
        for f in fakes:
            await f.close()
        ctx.term()


def test_a_worker_added_later_serves_and_a_drained_one_leaves_without_losing_requests() -> None:
    async def body(core: RouterCore, ctx: zmq.asyncio.Context, fakes: list[FakeWorker]) -> None:
        d1 = FakeWorker("D1", "decode", ctx, MODEL)
        fakes.append(d1)
        await core.add_worker(d1.endpoint, timeout_s=5)
        assert [w.worker_id for w in core.links.pools()["decode"]] == ["D0", "D1"]
        outs = await asyncio.gather(*(tokens(core, f"r{i}", [5, 6, 7, i]) for i in range(4)))
        assert all(len(o) == 20 for o in outs)
        assert "ExpectKV" in d1.handled  # round robin gave the new worker its share
        # drain D1 while a request runs on it: the request finishes there, then D1 leaves
        # (two requests: round robin puts one on each decode worker)
        running = [asyncio.ensure_future(tokens(core, f"late{i}", [9, 9, i])) for i in range(2)]
        w = core.links.find("D1")
        assert w is not None
        for _ in range(400):  # until a request is running on D1 (2 s at most)
            if core._busy(w):
                break
            await asyncio.sleep(0.005)
        assert core._busy(w)
        drained = await core.drain_worker(w, timeout_s=10)
        assert drained and not core._busy(w)
        core.remove_worker(w, "drained")
        assert [len(o) for o in await asyncio.gather(*running)] == [20, 20]
        assert core.links.find("D1") is None
        assert [w.worker_id for w in core.links.pools()["decode"]] == ["D0"]
        assert core.counters["workers_added"] == 1 and core.counters["workers_removed"] == 1
        assert core.counters["workers_down"] == 0  # a clean drain is no failure

    asyncio.run(with_core(body))


def test_removing_a_busy_worker_recovers_its_requests() -> None:
    async def body(core: RouterCore, ctx: zmq.asyncio.Context, fakes: list[FakeWorker]) -> None:
        job = asyncio.ensure_future(tokens(core, "r", [1, 2, 3]))
        d0 = core.links.find("D0")
        assert d0 is not None
        for _ in range(200):  # until the request is on D0
            if core._busy(d0):
                break
            await asyncio.sleep(0.005)
        core.remove_worker(d0, "removed")
        assert len(await job) == 20  # recovered: the rest ran whole on P0 (no D left)
        assert core.counters["recoveries"] == 1
        assert core.counters["local_fallbacks"] >= 1

    asyncio.run(with_core(body))


def test_a_worker_that_never_answers_is_not_added() -> None:
    async def body(core: RouterCore, ctx: zmq.asyncio.Context, fakes: list[FakeWorker]) -> None:
        with pytest.raises(RuntimeError, match="did not answer"):
            await core.add_worker("inproc://nobody-there", timeout_s=0.2)
        assert len(core.links.workers) == 2

    asyncio.run(with_core(body))


# ---- /admin/pools ------------------------------------------------------------------------------
class FakeScaler:
    def __init__(self) -> None:
        self.calls: list[dict[str, int]] = []

    def resize(self, targets: dict[str, int], by: str = "admin") -> dict[str, Any]:
        if targets.get("prefill") == 0 and targets.get("decode") == 0:
            raise RequestError("that would leave no worker to serve", 400, "invalid_value")
        self.calls.append(targets)
        return self.status()

    def status(self) -> dict[str, Any]:
        return {"object": "pools", "calls": len(self.calls)}


def client(default_tokenizer: Any, scaler: Any) -> TestClient:
    app = create_app(FakeCore(), default_tokenizer, model_name="m", scaler=scaler)
    return TestClient(app, raise_server_exceptions=False)


def test_admin_pools_resizes_through_the_scaler(default_tokenizer: Any) -> None:
    scaler = FakeScaler()
    c = client(default_tokenizer, scaler)
    r = c.post("/admin/pools", json={"prefill": 2, "decode": 3})
    assert r.status_code == 202 and r.json() == {"object": "pools", "calls": 1}
    assert scaler.calls == [{"prefill": 2, "decode": 3}]
    assert c.get("/admin/pools").json()["calls"] == 1


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[1, 2]",
        b'{"decode": -1}',
        b'{"decode": 65}',
        b'{"decode": "2"}',
        b'{"decode": 1.5}',
        b'{"decode": true}',
        b'{"workers": 2}',
        b"{}",
        b'{"prefill": 0, "decode": 0}',
    ],
)
def test_admin_pools_bad_input_is_a_400_envelope(default_tokenizer: Any, body: bytes) -> None:
    scaler = FakeScaler()
    r = client(default_tokenizer, scaler).post("/admin/pools", content=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert scaler.calls == []


def test_admin_pools_without_a_scaler_says_how_to_get_one(default_tokenizer: Any) -> None:
    c = client(default_tokenizer, None)
    for r in (c.get("/admin/pools"), c.post("/admin/pools", json={"decode": 2})):
        assert r.status_code == 409
        assert "--ray" in r.json()["error"]["message"]
    assert c.post("/admin/pools", json={"decode": -1}).status_code == 400  # input first


def test_admin_pools_shows_the_thread_split_of_adaptive_without_a_scaler(
    default_tokenizer: Any,
) -> None:
    core = FakeCore()
    split = {"cores": 2, "state": "lend_decode", "targets": {"P0": 1, "D0": 2}}
    core.roles = SimpleNamespace(threads=SimpleNamespace(status=lambda: split))  # type: ignore[attr-defined]
    c = TestClient(create_app(core, default_tokenizer, model_name="m"))
    r = c.get("/admin/pools")
    assert r.status_code == 200 and r.json() == {"resizable": False, "threads": split}
    assert c.post("/admin/pools", json={"prefill": 2}).status_code == 409  # still no scaler
    assert client(default_tokenizer, None).get("/admin/pools").status_code == 409
