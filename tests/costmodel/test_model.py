"""The cost model's arithmetic: a fit recovers known coefficients, predictions are never
negative, errors are reported, and the JSON round-trips (bad files are a clear ValueError)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve.costmodel.model import CostModel

TRUE = CostModel((0.02, 0.0018, 0.0004), (0.035, 0.004, 0.0009), (0.0005, 2e9))


def _samples(noise: float, seed: int = 0):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    jitter = lambda: 1 + noise * rng.standard_normal()  # noqa: E731
    pre = [(n, c, TRUE.prefill_s(n, c) * jitter()) for n in (16, 128, 512, 1024, 2048)
           for c in (0, 256, 1024)]  # fmt: skip
    dec = [(b, x, TRUE.decode_step_s(b, x) * jitter()) for b in (1, 2, 4, 8, 16, 32)
           for x in (b * 200, b * 1500)]  # fmt: skip
    xfer = [(n, TRUE.transfer_s(n) * jitter()) for n in (1 << 16, 1 << 20, 1 << 24, 1 << 26)]
    return pre, dec, xfer


def test_exact_samples_give_back_the_coefficients() -> None:
    pre, dec, xfer = _samples(noise=0.0)
    fit = CostModel.fit(pre, dec, xfer)
    np.testing.assert_allclose(fit.prefill, TRUE.prefill, rtol=1e-6)
    np.testing.assert_allclose(fit.decode, TRUE.decode, rtol=1e-6)
    np.testing.assert_allclose(fit.transfer, TRUE.transfer, rtol=1e-6)
    assert fit.errors(pre, dec)["prefill_p90"] < 1e-6


def test_noisy_samples_predict_within_a_few_percent() -> None:
    pre, dec, xfer = _samples(noise=0.03, seed=1)
    fit = CostModel.fit(pre, dec, xfer)
    err = fit.errors(*_samples(noise=0.0)[:2])  # against the true times
    assert err["prefill_p50"] < 0.05 and err["decode_p50"] < 0.05, err
    assert fit.prefill_s(1000) == pytest.approx(TRUE.prefill_s(1000), rel=0.05)
    # cached tokens make a prefill cheaper than computing them
    assert fit.prefill_s(100, cached=900) < fit.prefill_s(1000)


def test_no_negative_coefficients_or_times() -> None:
    # times that fall with size would need a negative slope: the fit clamps it at zero
    pre = [(n, 0, 1.0 - n / 4096) for n in (16, 256, 1024, 2048, 4000)]
    dec = [(b, 100 * b, 0.05) for b in (1, 2, 4, 8)]
    fit = CostModel.fit(pre, dec)
    assert min(fit.prefill) >= 0 and min(fit.decode) >= 0
    assert fit.prefill_s(4096) >= 0 and fit.decode_step_s(1, 0) > 0


def test_too_few_samples_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least 3 samples"):
        CostModel.fit([(16, 0, 0.1)], [(1, 10, 0.01)] * 3)


def test_json_round_trip_and_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "cm.json"
    TRUE.save(path, host="test", model="tiny")
    assert CostModel.load(path) == TRUE
    for bad in ("{", '{"version": 9}', '{"version": 1, "prefill": [1], "decode": [1, 2, 3], '
                '"transfer": [0, 1]}'):  # fmt: skip
        path.write_text(bad)
        with pytest.raises(ValueError):
            CostModel.load(path)
    with pytest.raises(ValueError, match="cannot read"):
        CostModel.load(tmp_path / "missing.json")


def test_relative_fit_evens_out_short_and_long_samples() -> None:
    pre, dec, xfer = _samples(noise=0.0)
    exact = CostModel.fit_relative(pre, dec, xfer)
    np.testing.assert_allclose(exact.prefill, TRUE.prefill, rtol=1e-6)
    np.testing.assert_allclose(exact.decode, TRUE.decode, rtol=1e-6)
    # one long sample 50% slow (a busy machine): the plain fit bends the short end for it
    pre = [*pre, (2048, 2048, TRUE.prefill_s(2048, 2048) * 1.5)]
    err_abs = CostModel.fit(pre, dec).errors(pre, dec)["prefill_p50"]
    err_rel = CostModel.fit_relative(pre, dec).errors(pre, dec)["prefill_p50"]
    assert err_rel < err_abs
    with pytest.raises(ValueError, match="> 0"):
        CostModel.fit_relative([(16, 0, 0.0), *pre], dec)


def test_scaled_multiplies_compute_and_keeps_transfer() -> None:
    half = TRUE.scaled(0.5)
    assert half.prefill_s(1000, 200) == pytest.approx(TRUE.prefill_s(1000, 200) / 2)
    assert half.decode_step_s(8, 4000) == pytest.approx(TRUE.decode_step_s(8, 4000) / 2)
    assert half.transfer == TRUE.transfer
    with pytest.raises(ValueError, match="> 0"):
        TRUE.scaled(0)


def test_default_path_is_per_host_model_and_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.costmodel.model import default_path, model_stem

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    path = default_path("/m/SmolLM2-135M-Instruct.Q4_1.gguf", 2, host="box 1")
    assert path == tmp_path / "costmodel" / "box_1-SmolLM2-135M-Instruct.Q4_1-t2.json"
    assert model_stem("/models/tiny-llama/") == "tiny-llama"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert default_path("x.gguf", 1).is_relative_to(Path.home() / ".cache" / "pdserve")
    with pytest.raises(ValueError, match="threads"):
        default_path("x.gguf", 0)


def test_load_about_returns_what_save_recorded(tmp_path: Path) -> None:
    path = tmp_path / "cm.json"
    TRUE.save(path, threads=2, host="h")
    assert CostModel.load_about(path) == {"threads": 2, "host": "h"}
    assert CostModel.load_about(tmp_path / "missing.json") == {}


# ---- version 3: a decode term per batch size, the D-side receive term ---------------------------
# a(1) = 50 ms, a(2) = 150 ms (another kernel path past one row), a(4) = 170 ms; 20 ms per 1k
# context tokens; D registers received KV at 1 ms + 10 us per token
BATCHED = CostModel(
    TRUE.prefill,
    TRUE.decode,
    TRUE.transfer,
    decode_by_batch=((1, 0.05), (2, 0.15), (4, 0.17)),
    decode_context=0.02,
    receive=(0.001, 1e-5),
)


def test_per_batch_terms_by_hand() -> None:
    m = BATCHED
    assert m.decode_step_s(1, 500) == pytest.approx(0.05 + 0.01)
    assert m.decode_step_s(2, 0) == pytest.approx(0.15)
    assert m.decode_step_s(3, 1000) == pytest.approx(0.16 + 0.02)  # halfway from 2 to 4
    # past the largest batch: along the last segment (10 ms per request)
    assert m.decode_step_s(8, 1000) == pytest.approx(0.17 + 4 * 0.01 + 0.02)
    assert m.decode_step_s(0, 0) == pytest.approx(0.05)  # a step's fixed part: the smallest
    assert m.receive_s(100) == pytest.approx(0.001 + 0.001) and m.receive_s(0) == 0.0
    assert TRUE.receive_s(100) == 0.0  # not profiled: nothing charged


def test_fit_recovers_per_batch_terms_and_beats_one_line() -> None:
    dec = [(b, x, BATCHED.decode_step_s(b, x)) for b in (1, 2, 4) for x in (b * 100, b * 900)]
    rec = [(n, BATCHED.receive_s(n)) for n in (16, 256, 2048)]
    pre = _samples(noise=0.0)[0]
    fit = CostModel.fit_relative(pre, dec, receive_samples=rec)
    assert [b for b, _ in fit.decode_by_batch] == [1, 2, 4]
    np.testing.assert_allclose([a for _, a in fit.decode_by_batch], [0.05, 0.15, 0.17], rtol=1e-6)
    assert fit.decode_context == pytest.approx(0.02, rel=1e-6)
    np.testing.assert_allclose(fit.receive, BATCHED.receive, rtol=1e-6)
    linear = CostModel.fit_relative(pre, dec, by_batch=False)
    assert linear.decode_by_batch == ()
    assert fit.errors(pre, dec)["decode_p90"] < 1e-6 < linear.errors(pre, dec)["decode_p50"]
    # one sample per batch size (fewer samples than terms): the one-line fit alone
    assert CostModel.fit(pre, dec[::2]).decode_by_batch == ()


def test_rescaled_scales_the_per_batch_terms_and_keeps_the_copies() -> None:
    k = BATCHED.rescaled(2.0, 0.5)
    assert k.prefill_s(300) == pytest.approx(2 * BATCHED.prefill_s(300))
    assert k.decode_step_s(3, 800) == pytest.approx(0.5 * BATCHED.decode_step_s(3, 800))
    assert k.transfer == BATCHED.transfer and k.receive == BATCHED.receive


def test_version_3_round_trip_and_version_2_files_still_load(tmp_path: Path) -> None:
    import json

    path = tmp_path / "cm.json"
    BATCHED.save(path)
    body = json.loads(path.read_text())
    assert body["version"] == 3 and body["decode_by_batch"] == [[1, 0.05], [2, 0.15], [4, 0.17]]
    assert CostModel.load(path) == BATCHED
    # a file written by the version-2 code: no per-batch terms, no receive term
    v2 = {"version": 2, "prefill": list(TRUE.prefill), "decode": list(TRUE.decode),
          "transfer": list(TRUE.transfer), "about": {}, "contention": {}}  # fmt: skip
    path.write_text(json.dumps(v2))
    old = CostModel.load(path)
    assert old == TRUE and old.decode_step_s(3, 900) == pytest.approx(TRUE.decode_step_s(3, 900))
    for bad in ([[2, 0.1], [1, 0.2]], [[0, 0.1]], "x"):  # unsorted, batch 0, not pairs
        path.write_text(json.dumps({**body, "decode_by_batch": bad}))
        with pytest.raises(ValueError, match="version-3"):
            CostModel.load(path)
