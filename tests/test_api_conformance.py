"""The official `openai` client against `pdserve serve` on two routes, colocated and 1P1D:
the same request gives the same output on both (greedy, seeded, penalized, biased, n > 1), and
the strict limits answer the same 400s."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from test_serve import Server


@pytest.fixture(scope="module")
def routes(tiny_llama_path):  # type: ignore[no-untyped-def]
    pd = Server(str(tiny_llama_path))  # 1 prefill + 1 decode worker (the default)
    colo = Server(str(tiny_llama_path), "--colocated", "1")
    yield {"1p1d": pd, "colocated": colo}
    pd.stop()
    colo.stop()


def _both(routes: dict[str, Server], **kw: Any) -> dict[str, Any]:
    out = {}
    for name, srv in routes.items():
        client = srv.client()
        model = client.models.list().data[0].id
        out[name] = client.completions.create(model=model, prompt="The quick brown fox", **kw)
    return out


CASES = [
    {"temperature": 0},
    {"temperature": 1.0, "seed": 1234},
    {"temperature": 0.8, "top_p": 0.9, "seed": 7, "frequency_penalty": 1.0},
    {
        "temperature": 0,
        "presence_penalty": 1.5,
        "extra_body": {"repetition_penalty": 1.3},
        "logit_bias": {"300": 5},
    },
]


@pytest.mark.parametrize("case", CASES)
def test_the_same_output_on_every_route(routes, case) -> None:  # type: ignore[no-untyped-def]
    got = _both(routes, max_tokens=10, **case)
    texts = {name: r.choices[0].text for name, r in got.items()}
    assert texts["1p1d"] == texts["colocated"], texts


def test_n_choices_on_every_route_equal_seed_plus_i(routes) -> None:  # type: ignore[no-untyped-def]
    eos = {"extra_body": {"ignore_eos": True}}
    got = _both(routes, max_tokens=8, n=3, temperature=1.0, seed=99, **eos)
    one = _both(routes, max_tokens=8, temperature=1.0, seed=99, **eos)["colocated"]
    for r in got.values():
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert r.usage.prompt_tokens == one.usage.prompt_tokens  # counted once, not n times
        assert r.usage.completion_tokens == 3 * 8
    assert [c.text for c in got["1p1d"].choices] == [c.text for c in got["colocated"].choices]
    assert len({c.text for c in got["colocated"].choices}) > 1
    for i in range(3):
        alone = _both(routes, max_tokens=8, temperature=1.0, seed=99 + i, **eos)["colocated"]
        assert alone.choices[0].text == got["colocated"].choices[i].text


def test_streamed_choices_carry_their_index(routes) -> None:  # type: ignore[no-untyped-def]
    for srv in routes.values():
        client = srv.client()
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            n=2,
            max_tokens=5,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text = {0: "", 1: ""}
        usage = None
        for chunk in stream:
            for ch in chunk.choices:
                text[ch.index] += ch.delta.content or ""
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 2 * 5
        assert all(text.values())


def test_strict_limits_on_a_real_server(routes) -> None:  # type: ignore[no-untyped-def]
    client = routes["1p1d"].client()
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=10**12)
    assert e.value.code == "context_length_exceeded"  # type: ignore[attr-defined]
    assert "maximum context length" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument"):
        client.completions.create(model=model, prompt="x", extra_body={"guided_json": {}})
    with pytest.raises(openai.BadRequestError, match="at most 4"):
        client.completions.create(model=model, prompt="x", stop=["a", "b", "c", "d", "e"])
