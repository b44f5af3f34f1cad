"""The sampler's logit processing: penalties, bias, and seeds keyed on (seed, position)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.request import SamplingParams
from pdserve.engine.sampler import Sampler, apply_penalties, argmax_rows, position_seed


def test_argmax_rows_is_torch_argmax_with_ties_and_nan() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 4096, generator=gen)
    logits[1, 7] = logits[1, 3000] = 99.0  # a tie: the first index wins
    logits[2, 11] = float("nan")  # NaN counts as the largest, as in torch
    logits[3] = float("-inf")
    assert argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits)[1:3] == [7, 11]
    assert argmax_rows(logits[:, ::2]) == logits[:, ::2].argmax(dim=-1).tolist()  # strided


def test_logit_bias_forces_and_bans_tokens_even_greedy() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    s = Sampler()
    params = SamplingParams(temperature=0, logit_bias={"3": 100})
    assert s.sample(logits, ["r"], [params])[0].token_id == 3
    params = SamplingParams(temperature=0, logit_bias={0: -100})
    assert s.sample(logits, ["r"], [params])[0].token_id == 1


def test_frequency_presence_and_repetition_penalties_by_hand() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, p, ([1], [0, 0, 2]))  # the prompt does not count here
    assert out.tolist() == pytest.approx([2.0 - 1.0 - 0.25, -2.0, 1.0 - 0.5 - 0.25, 0.5])
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), ([1], [0]))
    assert rep.tolist() == pytest.approx([1.0, -4.0, 1.0, 0.5])  # prompt and output count
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # the input is left alone


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9]])
    s = Sampler()
    p = SamplingParams(temperature=0, presence_penalty=0.5)
    assert s.sample(logits, ["r"], [p], [([], [])])[0].token_id == 0
    assert s.sample(logits, ["r"], [p], [([], [0])])[0].token_id == 1


def test_seeded_draw_depends_on_seed_and_position_only() -> None:
    logits = torch.zeros(3, 1000)
    p = SamplingParams(temperature=1.0, seed=9)
    hist = [([1], [4] * k) for k in range(3)]
    a = [r.token_id for r in Sampler(0).sample(logits, ["x", "y", "z"], [p] * 3, hist)]
    # another sampler (another worker), other request ids, rows alone: the same draws
    b = [Sampler(1).sample(logits[:1], [f"o{k}"], [p], [hist[k]])[0].token_id for k in range(3)]
    assert a == b and len(set(a)) > 1  # positions differ, so (almost surely) do the draws
    assert position_seed(9, 0) != position_seed(9, 1) != position_seed(10, 1)
    assert 0 <= position_seed(-(2**63), 5) < 2**64
