"""Speculation's pure parts: the n-gram proposer, the adaptive draft length, the rejection
sampler's distribution, and the config's refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.request import SamplingParams
from pdserve.engine.sampler import Sampler, filter_logits
from pdserve.engine.spec import ngram, rejection
from pdserve.spec_config import parse_speculative_config


def _propose(tokens: list[int], k: int = 3, lo: int = 1, hi: int = 3) -> list[int]:
    return ngram.propose(np.array(tokens), k, lo, hi).tolist()


def test_longest_suffix_ngram_wins_and_the_latest_occurrence() -> None:
    # suffix (1, 2): its 2-gram occurs at 0 (-> 7) and at 4 (-> 8); 1-gram 2 also at 6
    assert _propose([1, 2, 7, 9, 1, 2, 8, 5, 2, 1, 2]) == [8, 5, 2]
    # the 3-gram (5, 1, 2) beats the more recent 2-gram
    assert _propose([5, 1, 2, 6, 6, 1, 2, 4, 5, 1, 2]) == [6, 6, 1]
    assert _propose([1, 2, 3, 4]) == []  # nothing repeats
    assert _propose([1, 2, 3, 1], k=2) == [2, 3]
    assert _propose([1, 2, 3, 1], lo=2) == []  # a 1-gram match is below prompt_lookup_min
    assert _propose([4, 4, 4], k=5) == [4]  # draft ends where the sequence does


def test_a_match_reports_the_context_it_agrees_on() -> None:
    # suffix (1, 2) last seen at 5; before both occurrences: 9 agrees, then 7 != 2
    drafts, span = ngram.match(np.array([9, 1, 2, 7, 9, 1, 2, 8, 5, 2, 9, 1, 2]), 3, 1, 2)
    assert drafts.tolist() == [8, 5, 2] and span == 3
    # a periodic sequence agrees back to its start, and no further than MATCH_SPAN
    assert ngram.match(np.array([1, 2, 3, 1, 2, 3, 1, 2]), 3, 1, 2)[1] == 5
    assert ngram.match(np.array([1, 2] * 40), 2, 1, 4)[1] == ngram.MATCH_SPAN
    assert ngram.match(np.array([1, 2, 3, 4]), 3, 1, 2)[1] == 0  # nothing repeats


def test_draft_length_shrinks_on_rejection_and_grows_back() -> None:
    s = ngram.DraftState(4)
    assert s.k == 4
    s.observe(4, 0)
    s.observe(2, 0)
    assert s.k < 2
    for _ in range(20):
        s.observe(0, 0) if s.k == 0 else s.observe(s.k, s.k)
    assert s.k == 4
    assert s.sync([1, 2], [3]).tolist() == [1, 2, 3]
    assert s.sync([1, 2], [3, 4, 5]).tolist() == [1, 2, 3, 4, 5]
    assert s.sync([1, 2], [3, 4]).tolist() == [1, 2, 3, 4]  # a stop string cut tokens


def _tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return float(0.5 * np.abs(counts / counts.sum() - probs).sum())


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Each position's token is distributed as the processed target p (temperature, top-k),
    whatever the draft: total variation under 0.03 over 4000 draws (the sampling noise of 8
    categories at that count is about 0.01)."""
    torch.manual_seed(0)
    vocab, n = 8, 4000
    rows = torch.randn(3, vocab) * 1.5
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=8)
    p = [torch.softmax(filter_logits(rows[j] / 0.8, 6, 1.0), -1).numpy() for j in range(2)]
    draft = [int(np.argsort(p[0])[-2]), int(np.argmax(p[1]))]  # a likely, not the likeliest
    first, second = np.zeros(vocab), np.zeros(vocab)
    sampler = Sampler(1)
    for i in range(n):
        out = rejection.verify(sampler, f"r{i}", params, ([1], [2]), draft, rows.clone())
        first[out[0][0]] += 1
        if out[0][0] == draft[0]:  # accepted: the next token comes from row 1
            second[out[1][0]] += 1
    assert _tv(first, p[0]) < 0.03
    assert _tv(second, p[1]) < 0.05  # fewer draws: only those that accepted the first
    assert first[draft[0]] / n == pytest.approx(p[0][draft[0]], abs=0.03)


def test_greedy_verify_accepts_while_argmax_agrees() -> None:
    rows = torch.full((4, 6), -5.0)
    for j, t in enumerate([3, 1, 2, 5]):
        rows[j, t] = 5.0
    greedy = SamplingParams(temperature=0, max_tokens=8)
    tokens = [t for t, _ in rejection.verify(Sampler(), "r", greedy, ([0], []), [3, 1, 4], rows)]
    assert tokens == [3, 1, 2]  # third draft rejected: the argmax replaces it
    tokens = [t for t, _ in rejection.verify(Sampler(), "r", greedy, ([0], []), [3, 1, 2], rows)]
    assert tokens == [3, 1, 2, 5]  # all accepted: the bonus token


def test_seeded_verify_is_reproducible() -> None:
    rows = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=8)
    runs = [rejection.verify(Sampler(i), "r", params, ([1], [2]), [4, 9], rows) for i in range(3)]
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ('{"method": "eagle"}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens"),
        ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "lookup_max"),
        ('{"method": "ngram", "prompt_lookup_min": 0}', "prompt_lookup_min"),
        ('{"method": "ngram", "draft_model": "x"}', "draft_model"),
        ('{"num_speculative_tokens": 2}', "method"),
        ("{not json", "JSON"),
    ],
)
def test_bad_speculative_config_names_the_key(value: str, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        parse_speculative_config(value)
    with pytest.raises(ValueError, match=key):
        EngineConfig.from_kwargs(speculative_config=value)


def test_config_from_a_dict_travels_as_json() -> None:
    cfg = EngineConfig.from_kwargs(speculative_config={"method": "ngram", "prompt_lookup_max": 3})
    spec = parse_speculative_config(cfg.scheduler_config.speculative_config)
    assert spec is not None and spec.prompt_lookup_max == 3 and spec.num_speculative_tokens == 4
