"""`pdserve serve` end to end: real worker processes, the router over HTTP, the openai client."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from factories import die_with_parent, eventually
from pdserve import LLM, SamplingParams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, *args: str) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "serve",
                *args,
                "--port",
                str(self.port),
                "--threads",
                "1",
            ],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent,
            # An empty cache: a cost model that another test of this session profiled for the
            # same tiny model would turn on SLO routing (a request may then run whole on D).
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "PDSERVE_CACHE_DIR": tempfile.mkdtemp(prefix="pdserve-serve-test-"),
            },
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self._await("serving", 240)

    def _await(self, word: str, timeout_s: float) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            ready = select.select([self.proc.stdout], [], [], 1.0)[0]
            if ready and word in self.proc.stdout.readline():
                return
        self.stop()
        raise RuntimeError(f"pdserve serve did not start (exit {self.proc.poll()})")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tiny_llama_path):  # type: ignore[no-untyped-def]
    srv = Server(str(tiny_llama_path))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm(tiny_llama_path) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(tiny_llama_path))


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_completions_and_chat_match_llm(server, llm) -> None:  # type: ignore[no-untyped-def]
    client = server.client()
    model = _model(client)
    prompt = "The quick brown fox"
    want = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    got = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == want[0].outputs[0].text
    assert got.usage is not None and got.usage.completion_tokens == 12
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == want[0].outputs[0].text

    messages = [{"role": "user", "content": "Say hello"}]
    want_chat = llm.chat(messages, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    chat = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == want_chat[0].outputs[0].text
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want_chat[0].outputs[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_thirty_concurrent_streams_metrics_and_timeline(server) -> None:  # type: ignore[no-untyped-def]
    client = server.client()
    model = _model(client)

    def one(i: int) -> tuple[str, int]:
        stream = client.completions.create(
            model=model,
            prompt=f"Request number {i}",
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        rid, n = "", 0
        for chunk in stream:
            rid = chunk.id
            n += len(chunk.choices[0].text) > 0 if chunk.choices else 0
        return rid, n

    with ThreadPoolExecutor(30) as pool:
        results = list(pool.map(one, range(30)))
    assert len(results) == 30 and all(rid for rid, _ in results)

    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    ok = [
        s.value
        for s in families["pdserve_requests"].samples
        if s.labels.get("outcome") == "ok" and s.name.endswith("_total")
    ]
    assert ok and ok[0] >= 30
    assert any(
        s.value > 0
        for s in families["pdserve_request_ttft_seconds"].samples
        if s.name.endswith("_count")
    )

    def transferred() -> list[dict] | None:
        url = f"{server.url}/v1/requests/{results[0][0]}/timeline"
        events = httpx.get(url, timeout=10).json()["events"]
        stages = {e["event"] for e in events}
        return events if {"transfer_start", "transfer_end"} <= stages else None

    # P reports the transfer after D's ack, which may land after the stream ended (by design:
    # the report is added to the finished request's timeline), so wait for it.
    events = eventually(transferred, timeout_s=15, what="P's transfer report in the timeline")
    names = [e["event"] for e in events]
    order = ["arrive", "dispatch", "prefill_start", "prefill_end", "first_token", "finish"]
    assert [n for n in names if n in order] == order, names
    times = [e["t_ms"] for e in events]
    assert times == sorted(times)

    workers = httpx.get(server.url + "/admin/workers", timeout=10).json()
    assert {w["role"] for w in workers} == {"prefill", "decode"}
    assert all(w["healthy"] and w["kv_blocks_total"] > 0 for w in workers)

    # the workers' engine steps (a benchmark's level of the host during its load): P prefilled
    # prompts, D decoded; none begun after now
    steps = httpx.get(server.url + "/admin/steps", params={"since": 0}, timeout=30).json()
    assert set(steps["workers"]) == {w["id"] for w in workers} and steps["missing"] == []
    by_role = {w["role"]: steps["workers"][w["id"]] for w in workers}
    assert any(len(s) > 4 and s[4] > 1 for s in by_role["prefill"])  # a prompt chunk
    assert any(s[2] > 0 for s in by_role["decode"])  # decode rows
    later = httpx.get(server.url + "/admin/steps", params={"since": steps["now"] + 60}).json()
    assert all(v == [] for v in later["workers"].values())


def test_client_errors_get_openai_envelopes(server) -> None:  # type: ignore[no-untyped-def]
    client = server.client()
    model = _model(client)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "error" in r.json()


def test_sigterm_drains_and_exits_zero(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    srv = Server(str(tiny_llama_path), "--colocated", "1")
    client = srv.client()
    out = client.completions.create(model=_model(client), prompt="hi", max_tokens=4)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert srv.stop() == 0


def test_default_model_answers_paris_over_http() -> None:
    srv = Server()
    try:
        client = srv.client()
        chat = client.chat.completions.create(
            model=_model(client),
            temperature=0,
            max_tokens=32,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert "Paris" in (chat.choices[0].message.content or "")
        # The default (`--quantization auto`) runs the Q4_1 file's own weights on every worker,
        # against int16 activations.
        workers = httpx.get(srv.url + "/admin/workers", timeout=10).json()
        assert workers and {w["quantization"] for w in workers} == {"gguf-a16"}
    finally:
        assert srv.stop() == 0


def _wait_idle(url: str, timeout_s: float) -> list[dict]:  # type: ignore[type-arg]
    def idle() -> list[dict] | None:  # type: ignore[type-arg]
        workers = httpx.get(url + "/admin/workers", timeout=10).json()
        return (
            workers
            if all(w["running"] == 0 and w["kv_blocks_used"] == 0 for w in workers)
            else None
        )

    return eventually(idle, timeout_s, "every worker idle", interval_s=0.1)


def test_client_disconnect_frees_blocks_on_p_and_d(server) -> None:  # type: ignore[no-untyped-def]
    model = _model(server.client())
    body = {
        "model": model,
        "prompt": "Tell me a long story",
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then the client goes away
    gone = time.monotonic()
    _wait_idle(server.url, timeout_s=3)
    # Stats reach the router once a second; the request itself was cancelled well within that.
    assert time.monotonic() - gone < 3
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'pdserve_requests_total{outcome="aborted"}' in metrics


def test_router_alone_in_front_of_separately_started_workers(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    from pdserve.launcher import WorkerSpec, await_ready, launch, stop

    args = {"model": str(tiny_llama_path), "threads": 1}
    workers = [
        launch(WorkerSpec(role, f"{role[0].upper()}9", args)) for role in ("prefill", "decode")
    ]
    router = None
    try:
        for w in workers:
            await_ready(w, time.monotonic() + 120)
        port = _free_port()
        router = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "router",
                "--prefill",
                workers[0].control,
                "--decode",
                workers[1].control,
                "--port",
                str(port),
            ],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + 60
        assert router.stdout is not None
        while "serving" not in router.stdout.readline():
            assert time.monotonic() < deadline and router.poll() is None
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        out = client.completions.create(
            model=_model(client),
            prompt="Hi",
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.usage is not None and out.usage.completion_tokens == 5
        router.send_signal(signal.SIGTERM)
        assert router.wait(timeout=30) == 0
    finally:
        if router is not None and router.poll() is None:
            router.kill()
        for w in workers:
            assert w.proc is not None
            w.proc.terminate()
            stop(w)


def test_a_killed_worker_is_restarted_and_rejoins(server, llm) -> None:  # type: ignore[no-untyped-def]
    client = server.client()
    before = {w["role"]: w for w in httpx.get(server.url + "/admin/workers", timeout=10).json()}
    os.kill(before["decode"]["pid"], signal.SIGKILL)

    def restarted() -> bool:  # taken out within the liveness timeout, then back with a new pid
        rows = {w["role"]: w for w in httpx.get(server.url + "/admin/workers", timeout=10).json()}
        d = rows["decode"]
        return bool(d["healthy"] and d["pid"] not in (None, before["decode"]["pid"]))

    eventually(restarted, 60, "the killed decode worker to be restarted", interval_s=0.2)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = llm.generate("Hello again", params)[0].outputs[0].text
    out = client.completions.create(
        model=_model(client), prompt="Hello again", max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.choices[0].text == want
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'pdserve_worker_down_total{reason="no_heartbeat"} 1.0' in metrics
    _wait_idle(server.url, timeout_s=5)
