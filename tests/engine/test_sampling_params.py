"""engine.request.SamplingParams: validation names the bad field; stop strings normalise."""

from __future__ import annotations

import pytest

from pdserve.engine.request import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(temperature=-0.01), "temperature"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=-0.5), "top_p"),
        (dict(top_p=1.0001), "top_p"),
        (dict(top_p=2), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=-100), "top_k"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(stop=""), "stop"),
        (dict(stop=["ok", ""]), "stop"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=1),
        dict(temperature=0),
        dict(temperature=0.0),
        dict(temperature=2.0),
        dict(top_p=1),
        dict(top_p=1e-6),
        dict(top_k=-1),
        dict(top_k=1),
        dict(top_k=50),
        dict(logprobs=0),
        dict(logprobs=20),
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_validate_rechecks_after_mutation() -> None:
    params = SamplingParams()
    params.top_k = 0
    with pytest.raises(ValueError, match="top_k"):
        params.validate()


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (16, 1.0, 1.0, -1)
    assert p.stop is None and p.stop_strings == []
    assert not p.ignore_eos and p.stop_token_ids is None
    assert not p.greedy


def test_stop_string_becomes_a_list() -> None:
    p = SamplingParams(stop="###")
    assert p.stop == ["###"]
    assert p.stop_strings == ["###"]
    q = SamplingParams(stop=["a", "b"])
    assert q.stop == ["a", "b"] and q.stop_strings == ["a", "b"]
    q.stop_strings.append("c")  # a copy: the params are not changed through it
    assert q.stop == ["a", "b"]


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [(dict(temperature=0), True), (dict(top_k=1), True), (dict(temperature=0.7), False)],
)
def test_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_floats_are_refused(field: str, value: float) -> None:
    # a NaN temperature used to pass and then make the sampler raise inside an engine step
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
