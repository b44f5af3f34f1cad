"""Request.token_slice equals slicing all_token_ids, without building the whole sequence."""

from __future__ import annotations

import pytest

from pdserve.engine.request import Request, SamplingParams


@pytest.mark.parametrize(("start", "stop"), [(0, 3), (2, 5), (5, 7), (6, 7), (0, 7), (4, 4)])
def test_token_slice_matches_all_token_ids(start: int, stop: int) -> None:
    r = Request("r", [10, 11, 12, 13, 14], SamplingParams(max_tokens=4))
    r.append_token(20)
    r.append_token(21)
    assert r.token_slice(start, stop) == r.all_token_ids[start:stop]
