"""router/step_logs.py: the workers' step logs asked for and awaited (fake workers: a `send`
that records, answers given by hand), and GET /admin/steps."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fake_core import FakeCore
from fastapi.testclient import TestClient

from pdserve.router.app import create_app
from pdserve.router.step_logs import StepLogs
from pdserve.workers import messages as m


@dataclass
class Worker:
    worker_id: str
    healthy: bool = True
    info: object | None = "up"


def scripted(answers: dict[str, list[list[m.Steps]]]) -> tuple[StepLogs, list[tuple[str, object]]]:
    """StepLogs over fake workers: the k-th question to a worker is answered, on the loop's
    next turn, by the messages of its k-th script entry, in order (none: it stays silent)."""
    sent: list[tuple[str, object]] = []

    def send(w: Worker, msg: object) -> None:
        sent.append((w.worker_id, msg))
        for reply in answers[w.worker_id].pop(0):
            asyncio.get_running_loop().call_soon(logs.answer, reply)

    logs = StepLogs(send)
    return logs, sent


def test_each_healthy_worker_is_asked_and_its_answer_kept() -> None:
    logs, sent = scripted({
        "P0": [[m.Steps("P0", [[12.6, 0.3, 0, 0, 64, 0]])]],  # threads not recorded
        "D0": [[m.Steps("D0", [[13.0, 0.02, 1, 40]], [1])]],
    })  # fmt: skip
    workers = [Worker("P0"), Worker("D0"), Worker("X", healthy=False), Worker("Y", info=None)]
    out = asyncio.run(logs.collect(workers, 12.5, timeout_s=5))
    assert sent == [("P0", m.GetSteps(12.5)), ("D0", m.GetSteps(12.5))]  # not the down ones
    assert out["since"] == 12.5 and out["missing"] == []
    assert out["workers"] == {"P0": [[12.6, 0.3, 0, 0, 64, 0]], "D0": [[13.0, 0.02, 1, 40]]}
    assert out["threads"] == {"P0": [], "D0": [1]}


def test_a_silent_worker_is_named_and_its_late_answer_dropped() -> None:
    late = m.Steps("D0", [[1.2, 0.1, 1, 5]])  # D0's answer to the first question, too late
    logs, _ = scripted({
        "P0": [[m.Steps("P0", [[1.5, 0.1, 2, 10]])],
               [m.Steps("P0", []), m.Steps("P0", [[9.0, 0.1, 1, 1]])]],  # the second unasked
        "D0": [[], [late, m.Steps("D0", [[2.2, 0.1, 1, 6]])]],
    })  # fmt: skip
    workers = [Worker("P0"), Worker("D0")]

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        first = await logs.collect(workers, 1.0, timeout_s=0.05)
        return first, await logs.collect(workers, 2.0, timeout_s=5)

    got, second = asyncio.run(run())
    assert got["workers"] == {"P0": [[1.5, 0.1, 2, 10]]} and got["missing"] == ["D0"]
    assert second["workers"] == {"P0": [], "D0": [[2.2, 0.1, 1, 6]]} and second["missing"] == []


def test_admin_steps_over_http(default_tokenizer: Any) -> None:
    """A core without links (the fake) answers no workers; a `since` that is not a number is
    OpenAI's 400 envelope."""
    app = create_app(FakeCore(), default_tokenizer, model_name="m", max_model_len=64)
    client = TestClient(app, raise_server_exceptions=False)
    body = client.get("/admin/steps", params={"since": 3.5}).json()
    assert body["since"] == 3.5 and body["workers"] == {} and body["now"] > 0
    bad = client.get("/admin/steps", params={"since": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
