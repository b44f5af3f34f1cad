"""Structured outputs in the engine: constraints are validated, the sampler's mask keeps every
token inside the grammar (greedy, sampled, penalized), outputs parse and validate, the grammar's
end stops the request, max_tokens truncates, n > 1 forks and the P -> D hand-off replay give the
one-engine result."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest
import torch

from factories import assert_engine_idle, handoff
from pdserve import LLM, SamplingParams
from pdserve.engine.grammar import check_spec
from pdserve.engine.sampler import Sampler

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["admin", "user"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "ok"],
    "additionalProperties": False,
}
PROMPT = "Describe a user as JSON:"


@pytest.fixture(scope="module")
def tiny(tiny_llama_path) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(tiny_llama_path), block_size=8, num_blocks=256)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("json", "must be an object"),
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
        ({"yaml": "x"}, "unknown constraint"),
        ({"regex": "(["}, "regex.*invalid"),
        ({"json": {"type": "nonsense"}}, "json is invalid"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"choice": []}, "non-empty list"),
        ({"json_object": "yes"}, "must be true"),
        ({"grammar": "start: ("}, "grammar is invalid"),
    ],
)
def test_bad_constraints_are_value_errors(spec, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        check_spec(spec)
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_outputs=spec)


def test_sampler_mask_wins_over_bias_greedy_and_sampling() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(100, dtype=torch.bool)
    mask[[7, 42]] = True
    biased = SamplingParams(temperature=0, logit_bias={3: 100.0}, max_tokens=1)
    sampled = SamplingParams(temperature=2.0, top_p=0.9, seed=1, logprobs=5, max_tokens=1)
    out = Sampler().sample(
        logits,
        ["a", "b", "c"],
        [biased, sampled, biased],
        masks=[mask, mask, None],
    )
    assert out[0].token_id in (7, 42) and out[1].token_id in (7, 42)
    assert out[2].token_id == 3  # the unmasked row still takes its bias
    assert out[1].logprobs is not None and set(out[1].logprobs) <= {7, 42}  # no -inf entries


def _run(llm: LLM, params: SamplingParams, prompt: str = PROMPT) -> tuple[str, str | None]:
    c = llm.generate([prompt], params)[0].outputs[0]
    return c.text, c.finish_reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates_and_stops(tiny, temperature) -> None:  # type: ignore[no-untyped-def]
    validator = jsonschema_rs.validator_for(SCHEMA)
    for seed in range(3):
        params = SamplingParams(
            max_tokens=80, temperature=temperature, seed=seed, structured_outputs={"json": SCHEMA}
        )
        text, finish = _run(tiny, params)
        assert finish == "stop", text
        assert validator.is_valid(json.loads(text)), text
    assert_engine_idle(tiny)


def test_regex_choice_and_json_object(tiny) -> None:  # type: ignore[no-untyped-def]
    text, finish = _run(
        tiny, SamplingParams(max_tokens=20, structured_outputs={"regex": r"[0-9]{3}-[a-c]{2}"})
    )
    assert finish == "stop"
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", text)
    choices = ["positive", "negative", "neutral"]
    for seed in range(3):
        text, finish = _run(
            tiny,
            SamplingParams(
                max_tokens=10, temperature=1.0, seed=seed, structured_outputs={"choice": choices}
            ),
        )
        assert text in choices and finish == "stop"
    text, finish = _run(
        tiny, SamplingParams(max_tokens=60, temperature=0, structured_outputs={"json_object": True})
    )
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # truncated: a prefix of an object
        assert finish == "length" and text.startswith("{")


def test_max_tokens_truncates_with_length(tiny) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=3, temperature=0, structured_outputs={"json": SCHEMA})
    text, finish = _run(tiny, params)
    full, _ = _run(tiny, SamplingParams(**{**params.__dict__, "max_tokens": 80}))
    assert finish == "length" and full.startswith(text) and len(text) < len(full)


def test_n_choices_each_follow_the_grammar(tiny) -> None:  # type: ignore[no-untyped-def]
    validator = jsonschema_rs.validator_for(SCHEMA)
    params = SamplingParams(
        max_tokens=80, temperature=1.0, seed=7, n=3, structured_outputs={"json": SCHEMA}
    )
    outs = tiny.generate([PROMPT], params)[0].outputs
    assert len(outs) == 3
    for c in outs:
        assert c.finish_reason == "stop" and validator.is_valid(json.loads(c.text)), c.text
    # choice i equals a separate request with seed + i (forks replay their first token)
    for i, c in enumerate(outs):
        alone = tiny.generate([PROMPT], params.for_choice(i))[0].outputs[0]
        assert alone.token_ids == c.token_ids
    assert_engine_idle(tiny)


@pytest.mark.parametrize("k", [2])
def test_handoff_replays_the_grammar_state(tiny_llama_path, k) -> None:  # type: ignore[no-untyped-def]
    path = str(tiny_llama_path)
    ref = LLM(path, block_size=8, num_blocks=256)
    p = LLM(path, block_size=4, num_blocks=256)
    d = LLM(path, block_size=4, num_blocks=256)
    prompt = p.engine.tokenize(PROMPT)[1]
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            max_tokens=80, temperature=temperature, seed=3, structured_outputs={"json": SCHEMA}
        )
        want = ref.generate([prompt], params)[0].outputs[0].token_ids
        assert handoff(p, d, prompt, params, k) == want
    for llm in (ref, p, d):
        assert_engine_idle(llm)


def test_a_replay_that_breaks_the_grammar_is_refused(tiny) -> None:  # type: ignore[no-untyped-def]
    eng = tiny.engine
    params = SamplingParams(max_tokens=5, structured_outputs={"regex": "[0-9]+"})
    prompt = eng.tokenize(PROMPT)[1]
    assert eng.reserve_kv(prompt, params, "bad", len(prompt)) is not None
    letter = eng.tokenizer.encode("x", add_special_tokens=False)
    with pytest.raises(ValueError, match="does not fit the grammar"):
        eng.admit_prefilled("bad", letter, len(prompt))
    assert_engine_idle(tiny)


def test_the_constraint_travels_in_the_wire_params() -> None:
    from pdserve.workers import messages as m

    params = SamplingParams(structured_outputs={"json": {"type": "object"}}, n=2)
    back = m.decode(m.encode(m.Prefill("r", [1, 2], params.to_wire(), "D0", "tcp://x", 1)))
    assert m.sampling_params(back.params) == params  # type: ignore[attr-defined]
    assert "structured_outputs" not in SamplingParams().to_wire()  # absent when unset


def test_a_grammar_that_gives_up_ends_with_eos_not_a_crash() -> None:
    from pdserve.engine.grammar import Matcher

    class GaveUp:  # what llguidance does past a resource limit: an error state, nothing allowed
        def compute_bitmask(self) -> bytes:
            return bytes(4)

        def is_error(self) -> bool:
            return True

        def get_error(self) -> str:
            return "lexer fuel exhausted"

        def is_stopped(self) -> bool:
            return False

    m = Matcher(GaveUp(), 32, eos_token_id=2)
    assert m.allowed().nonzero().flatten().tolist() == [2]
    assert m.done and m.error == "lexer fuel exhausted"
    m.accept(2)  # no-op once given up
