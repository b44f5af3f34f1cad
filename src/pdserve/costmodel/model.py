"""A cost model of one worker: how long a prefill, a decode step and a KV transfer take.

    prefill(new, cached)  = p0 + p1 * new + p2 * new * (cached + new / 2) / 1000
    decode_step(batch, L) = d0 + d1 * batch + d2 * L / 1000        (L: context tokens, summed)
    transfer(bytes)       = t0 + bytes / t1

Why these terms: prefill is matrix products over the new tokens (linear) plus attention of
each new token over everything before it (the product term; cached tokens are read, not
recomputed); a decode step reads the weights once (constant), does per-row work (batch) and
reads every running request's KV (total context); a transfer is a fixed cost plus bytes over a
bandwidth. Coefficients are fitted by non-negative least squares on measured samples, so the
model cannot predict negative times, and is stored as JSON per host and model.

The router (issue 6) uses it to predict a request's TTFT and TPOT from the current queues; this
module only knows arithmetic: no sockets, no engine.
"""

from __future__ import annotations

import json
import os
import platform
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

VERSION = 2  # 2: may carry a "contention" section (costmodel/contention.py); 1 still loads
READABLE_VERSIONS = (1, 2)


def _prefill_row(new: float, cached: float) -> list[float]:
    return [1.0, new, new * (cached + new / 2) / 1000]


def _decode_row(batch: float, context: float) -> list[float]:
    return [1.0, batch, context / 1000]


def _nnls(rows: list[list[float]], ys: list[float]) -> list[float]:
    from scipy.optimize import nnls

    if len(rows) < len(rows[0]):
        raise ValueError(f"need at least {len(rows[0])} samples to fit, got {len(rows)}")
    a, b = np.asarray(rows, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    # scale columns to comparable magnitudes: nnls is exact, but badly scaled columns cost digits
    scale = np.maximum(np.abs(a).max(axis=0), 1e-12)
    coef, _ = nnls(a / scale, b)
    return [float(c) for c in coef / scale]


def _nnls_relative(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares of sum(((row . coef) - y) / y)^2: rows and targets over y."""
    if any(not y > 0 for y in ys):
        raise ValueError("a relative fit needs every measured time > 0")
    return _nnls([[x / y for x in row] for row, y in zip(rows, ys, strict=True)], [1.0] * len(ys))


@dataclass(frozen=True)
class CostModel:
    prefill: tuple[float, float, float]
    decode: tuple[float, float, float]
    transfer: tuple[float, float] = (0.0, 1e12)  # (fixed s, bytes/s)

    def prefill_s(self, new: int, cached: int = 0) -> float:
        return float(np.dot(self.prefill, _prefill_row(new, cached)))

    def decode_step_s(self, batch: int, context: int) -> float:
        return float(np.dot(self.decode, _decode_row(batch, context)))

    def transfer_s(self, nbytes: int) -> float:
        fixed, bandwidth = self.transfer
        return fixed + nbytes / bandwidth

    def scaled(self, factor: float) -> CostModel:
        """The same worker `factor` times slower at compute (prefill and decode times times
        `factor`; < 1 is faster). The transfer is left alone: it is bound by the link and
        memory copies, not by the worker's compute threads."""
        if not factor > 0:
            raise ValueError(f"a scale factor must be > 0, got {factor}")
        p, d = self.prefill, self.decode
        return CostModel(
            (p[0] * factor, p[1] * factor, p[2] * factor),
            (d[0] * factor, d[1] * factor, d[2] * factor),
            self.transfer,
        )

    # ---- fitting --------------------------------------------------------------------------
    @classmethod
    def fit(
        cls,
        prefill_samples: Sequence[tuple[int, int, float]],
        decode_samples: Sequence[tuple[int, int, float]],
        transfer_samples: Sequence[tuple[int, float]] = (),
    ) -> CostModel:
        """From (new, cached, s), (batch, context, s) and (bytes, s) measurements."""
        return cls._fit(_nnls, prefill_samples, decode_samples, transfer_samples)

    @classmethod
    def fit_relative(
        cls,
        prefill_samples: Sequence[tuple[int, int, float]],
        decode_samples: Sequence[tuple[int, int, float]],
        transfer_samples: Sequence[tuple[int, float]] = (),
    ) -> CostModel:
        """As `fit`, but minimizing squared relative errors: every sample weighs 1 / its time.

        `fit` minimizes absolute errors, so samples spanning 50 ms to 5 s are fitted for the
        5 s ones and the short ones can be off by 2x; `errors` (and a router deciding between a
        short and a long prompt) judge relative errors, which this fit makes even.
        """
        return cls._fit(_nnls_relative, prefill_samples, decode_samples, transfer_samples)

    @classmethod
    def _fit(
        cls,
        solve: Callable[[list[list[float]], list[float]], list[float]],
        prefill_samples: Sequence[tuple[int, int, float]],
        decode_samples: Sequence[tuple[int, int, float]],
        transfer_samples: Sequence[tuple[int, float]],
    ) -> CostModel:
        p = solve([_prefill_row(n, c) for n, c, _ in prefill_samples],
                  [s for *_, s in prefill_samples])  # fmt: skip
        d = solve([_decode_row(b, ctx) for b, ctx, _ in decode_samples],
                  [s for *_, s in decode_samples])  # fmt: skip
        transfer: tuple[float, float] = (0.0, 1e12)
        if transfer_samples:
            t0, per_byte = solve([[1.0, float(n)] for n, _ in transfer_samples],
                                 [s for _, s in transfer_samples])  # fmt: skip
            transfer = (t0, 1.0 / per_byte if per_byte > 0 else 1e12)
        return cls((p[0], p[1], p[2]), (d[0], d[1], d[2]), transfer)

    def errors(
        self,
        prefill_samples: Sequence[tuple[int, int, float]],
        decode_samples: Sequence[tuple[int, int, float]],
    ) -> dict[str, float]:
        """Median and p90 of |predicted - measured| / measured, per kind."""
        out = {}
        for kind, rel in (
            ("prefill", [abs(self.prefill_s(n, c) - s) / s for n, c, s in prefill_samples]),
            ("decode", [abs(self.decode_step_s(b, x) - s) / s for b, x, s in decode_samples]),
        ):
            if rel:
                out[f"{kind}_p50"] = float(np.percentile(rel, 50))
                out[f"{kind}_p90"] = float(np.percentile(rel, 90))
        return out

    # ---- storage --------------------------------------------------------------------------
    def save(self, path: Path, **about: object) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"version": VERSION, **asdict(self), "about": about}
        path.write_text(json.dumps(body, indent=1) + "\n")

    @staticmethod
    def load_about(path: Path) -> dict[str, object]:
        """The `about` dict a file was saved with ({} when it has none or is unreadable)."""
        try:
            about = json.loads(path.read_text()).get("about", {})
        except (OSError, json.JSONDecodeError, AttributeError):
            return {}
        return about if isinstance(about, dict) else {}

    @classmethod
    def load(cls, path: Path) -> CostModel:
        try:
            body = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read a cost model from {path}: {e}") from None
        if not isinstance(body, dict) or body.get("version") not in READABLE_VERSIONS:
            raise ValueError(f"{path} is not a version-{VERSION} cost model")
        try:
            prefill = tuple(float(x) for x in body["prefill"])
            decode = tuple(float(x) for x in body["decode"])
            transfer = tuple(float(x) for x in body["transfer"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: malformed cost model") from None
        if len(prefill) != 3 or len(decode) != 3 or len(transfer) != 2:
            raise ValueError(f"{path}: malformed cost model")
        return cls(prefill, decode, transfer)  # type: ignore[arg-type]


# ---- where cost models live --------------------------------------------------------------------
def cache_dir() -> Path:
    """$PDSERVE_CACHE_DIR if set, else ~/.cache/pdserve."""
    root = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "pdserve"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "unknown"


def model_stem(model_name: str) -> str:
    """A model file's or folder's name without `.gguf`: `SmolLM2-135M-Instruct.Q4_1`."""
    name = Path(model_name).name
    return _slug(name[: -len(".gguf")] if name.lower().endswith(".gguf") else name)


def default_path(
    model_name: str, threads: int, host: str | None = None, quantization: str = "none"
) -> Path:
    """`<cache>/costmodel/<host>-<model stem>[-<quantization>]-t<threads>.json`.

    One file per host, model, weight quantization and thread count, because a cost model is a
    measurement of exactly that combination: another CPU, model, quantization or thread count
    has other coefficients. (`none` adds nothing, so files saved before quantization existed
    still apply.)
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    host = _slug(host if host is not None else platform.node())
    quant = "" if quantization == "none" else f"-{_slug(quantization)}"
    return cache_dir() / "costmodel" / f"{host}-{model_stem(model_name)}{quant}-t{threads}.json"
