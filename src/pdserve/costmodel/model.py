"""A cost model of one worker: how long a prefill, a decode step and a KV transfer take.

    prefill(new, cached)  = p0 + p1 * new + p2 * new * (cached + new / 2) / 1000
    decode_step(batch, L) = a(batch) + dc * L / 1000               (L: context tokens, summed)
                          or, without per-batch terms, d0 + d1 * batch + d2 * L / 1000
    transfer(bytes)       = t0 + bytes / t1
    receive(tokens)       = r0 + r1 * tokens     (D's own work to register a hand-off's KV)

Why these terms: prefill is matrix products over the new tokens (linear) plus attention of
each new token over everything before it (the product term; cached tokens are read, not
recomputed); a decode step reads the weights once (constant), does per-row work (batch) and
reads every running request's KV (total context); a transfer is a fixed cost plus bytes over a
bandwidth. Coefficients are fitted by non-negative least squares on measured samples, so the
model cannot predict negative times, and is stored as JSON per host and model.

Why a term per batch size (version 3): a measured CPU decode step is not linear in the batch:
on this host with SmolLM2-135M Q4_1 a batch of 1 takes 53 ms and a batch of 2 148 ms (another
kernel path once there is more than one row), then the step grows slowly to 205 ms at 32. One
line through batch and context missed such steps by 30% (median); `a(batch)` is one fitted
intercept per profiled batch size, linear between them (and past the largest, along the last
segment), with one shared term per context token. A decode worker alone at batch 1-3 is then
predicted from its own measured steps.

Why a receive term (version 3): a decode worker decodes each arriving KV frame and copies it
into its cache on its own loop, between engine steps, so a hand-off costs D `receive(tokens)`
of its time: it delays D's next step for every request decoding there. `transfer` is the rest
of the hand-off's latency (P's encoding and the wire).

The router (issue 6) uses it to predict a request's TTFT and TPOT from the current queues; this
module only knows arithmetic: no sockets, no engine.
"""

from __future__ import annotations

import itertools
import json
import platform
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from pdserve.config import cache_dir  # where cost models live
from pdserve.percentiles import percentiles

# 3: per-batch decode terms and the D-side receive term; 2: may carry a "contention" section
# (costmodel/contention.py); 1 and 2 still load (no per-batch terms, receive = 0)
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)


def _prefill_row(new: float, cached: float) -> list[float]:
    return [1.0, new, new * (cached + new / 2) / 1000]


def _decode_row(batch: float, context: float) -> list[float]:
    return [1.0, batch, context / 1000]


def _by_batch_rows(
    samples: Sequence[tuple[int, int, float]],
) -> tuple[list[int], list[list[float]]] | None:
    """One indicator column per distinct batch size + a context column, or None when the
    samples cannot fit that many terms (fewer samples than terms, or a single batch size)."""
    batches = sorted({b for b, _, _ in samples})
    if len(batches) < 2 or len(samples) < len(batches) + 1:
        return None
    index = {b: i for i, b in enumerate(batches)}
    rows = []
    for b, ctx, _ in samples:
        row = [0.0] * (len(batches) + 1)
        row[index[b]], row[-1] = 1.0, ctx / 1000
        rows.append(row)
    return batches, rows


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
    # (batch size, step intercept s), ascending; () = the linear `decode` terms only
    decode_by_batch: tuple[tuple[int, float], ...] = ()
    decode_context: float = 0.0  # s per 1k context tokens, with `decode_by_batch`
    receive: tuple[float, float] = (0.0, 0.0)  # D side: (fixed s, s per KV token received)

    def prefill_s(self, new: int, cached: int = 0) -> float:
        return float(np.dot(self.prefill, _prefill_row(new, cached)))

    def decode_step_s(self, batch: float, context: int) -> float:
        """One decode step of `batch` rows over `context` tokens in all (a fractional batch, as
        the analytic planner's mean, is interpolated like any batch between profiled sizes)."""
        if not self.decode_by_batch:
            return float(np.dot(self.decode, _decode_row(batch, context)))
        return self._batch_intercept(batch) + self.decode_context * context / 1000

    def _batch_intercept(self, batch: float) -> float:
        """Linear between the profiled batch sizes; below the smallest, the smallest's (a step
        reads the weights whatever its batch); past the largest, along the last segment's
        slope (not below 0), or the linear `d1` with a single batch size."""
        knots = self.decode_by_batch
        b0, a0 = knots[0]
        if batch <= b0:
            return a0
        for (lo, a_lo), (hi, a_hi) in itertools.pairwise(knots):
            if batch <= hi:
                return a_lo + (a_hi - a_lo) * (batch - lo) / (hi - lo)
        b1, a1 = knots[-1]
        slope = self.decode[1] if len(knots) < 2 else (a1 - knots[-2][1]) / (b1 - knots[-2][0])
        return a1 + max(0.0, slope) * (batch - b1)

    def receive_s(self, tokens: int) -> float:
        """D's own time to register `tokens` tokens of a hand-off's KV (0 when not profiled)."""
        fixed, per_token = self.receive
        return fixed + per_token * tokens if tokens > 0 else 0.0

    def transfer_s(self, nbytes: int) -> float:
        fixed, bandwidth = self.transfer
        return fixed + nbytes / bandwidth

    def scaled(self, factor: float) -> CostModel:
        """The same worker `factor` times slower at compute (prefill and decode times times
        `factor`; < 1 is faster). The transfer is left alone: it is bound by the link and
        memory copies, not by the worker's compute threads."""
        if not factor > 0:
            raise ValueError(f"a scale factor must be > 0, got {factor}")
        return self.rescaled(factor, factor)

    def rescaled(self, prefill_x: float, decode_x: float) -> CostModel:
        """Prefill terms times `prefill_x`, decode terms (per-batch ones included) times
        `decode_x`; transfer and receive (memory copies) left alone."""
        if not (prefill_x > 0 and decode_x > 0):
            raise ValueError(f"scale factors must be > 0, got {prefill_x}, {decode_x}")
        p, d = self.prefill, self.decode
        return replace(
            self,
            prefill=(p[0] * prefill_x, p[1] * prefill_x, p[2] * prefill_x),
            decode=(d[0] * decode_x, d[1] * decode_x, d[2] * decode_x),
            decode_by_batch=tuple((b, a * decode_x) for b, a in self.decode_by_batch),
            decode_context=self.decode_context * decode_x,
        )

    # ---- fitting --------------------------------------------------------------------------
    @classmethod
    def fit(
        cls,
        prefill_samples: Sequence[tuple[int, int, float]],
        decode_samples: Sequence[tuple[int, int, float]],
        transfer_samples: Sequence[tuple[int, float]] = (),
        receive_samples: Sequence[tuple[int, float]] = (),
        *,
        by_batch: bool = True,
    ) -> CostModel:
        """From (new, cached, s), (batch, context, s), (bytes, s) and (tokens, s) measurements.
        `by_batch`: also fit a decode intercept per batch size (when the samples allow)."""
        return cls._fit(
            _nnls, prefill_samples, decode_samples, transfer_samples, receive_samples, by_batch
        )

    @classmethod
    def fit_relative(
        cls,
        prefill_samples: Sequence[tuple[int, int, float]],
        decode_samples: Sequence[tuple[int, int, float]],
        transfer_samples: Sequence[tuple[int, float]] = (),
        receive_samples: Sequence[tuple[int, float]] = (),
        *,
        by_batch: bool = True,
    ) -> CostModel:
        """As `fit`, but minimizing squared relative errors: every sample weighs 1 / its time.

        `fit` minimizes absolute errors, so samples spanning 50 ms to 5 s are fitted for the
        5 s ones and the short ones can be off by 2x; `errors` (and a router deciding between a
        short and a long prompt) judge relative errors, which this fit makes even.
        """
        return cls._fit(
            _nnls_relative,
            prefill_samples,
            decode_samples,
            transfer_samples,
            receive_samples,
            by_batch,
        )

    @classmethod
    def _fit(
        cls,
        solve: Callable[[list[list[float]], list[float]], list[float]],
        prefill_samples: Sequence[tuple[int, int, float]],
        decode_samples: Sequence[tuple[int, int, float]],
        transfer_samples: Sequence[tuple[int, float]],
        receive_samples: Sequence[tuple[int, float]] = (),
        by_batch: bool = False,
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
        receive: tuple[float, float] = (0.0, 0.0)
        if receive_samples:
            r0, r1 = solve([[1.0, float(n)] for n, _ in receive_samples],
                           [s for _, s in receive_samples])  # fmt: skip
            receive = (r0, r1)
        knots: tuple[tuple[int, float], ...] = ()
        context = 0.0
        split = _by_batch_rows(decode_samples) if by_batch else None
        if split is not None:
            batches, rows = split
            coef = solve(rows, [s for *_, s in decode_samples])
            knots = tuple(zip(batches, coef[:-1], strict=True))
            context = coef[-1]
        return cls((p[0], p[1], p[2]), (d[0], d[1], d[2]), transfer, knots, context, receive)

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
                for key, value in percentiles(rel, (50, 90)).items():
                    if value is not None:  # never: `rel` has samples
                        out[f"{kind}_{key}"] = value
        return out

    # ---- storage --------------------------------------------------------------------------
    def save(self, path: Path, **about: object) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"version": VERSION, **asdict(self), "about": about}
        body["decode_by_batch"] = [list(k) for k in self.decode_by_batch]
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
        model = cls(prefill, decode, transfer)  # type: ignore[arg-type]
        return model if body["version"] < 3 else cls._load_v3(path, body, model)

    @staticmethod
    def _load_v3(path: Path, body: dict[str, object], model: CostModel) -> CostModel:
        """The version-3 terms: per-batch decode intercepts and the receive term."""
        try:
            knots = tuple(
                (int(b), float(a))
                for b, a in body.get("decode_by_batch", ())  # type: ignore[attr-defined]
            )
            context = float(body.get("decode_context", 0.0))  # type: ignore[arg-type]
            receive = tuple(float(x) for x in body.get("receive", (0.0, 0.0)))  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            raise ValueError(f"{path}: malformed cost model (version-3 terms)") from None
        batches = [b for b, _ in knots]
        if len(receive) != 2 or batches != sorted(set(batches)) or any(b < 1 for b in batches):
            raise ValueError(f"{path}: malformed cost model (version-3 terms)")
        return replace(
            model,
            decode_by_batch=knots,
            decode_context=context,
            receive=receive,  # type: ignore[arg-type]
        )


# ---- where cost models live --------------------------------------------------------------------
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "unknown"


def model_stem(model_name: str) -> str:
    """A model file's or folder's name without `.gguf`: `SmolLM2-135M-Instruct.Q4_1`."""
    name = Path(model_name).name
    return _slug(name[: -len(".gguf")] if name.lower().endswith(".gguf") else name)


def default_path(
    model_name: str,
    threads: int,
    host: str | None = None,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
    decode_matmul: str = "auto",
    prefill_format: str = "none",
) -> Path:
    """`<cache>/costmodel/<host>-<model stem>[-<quantization>][-kv-<dtype>][-mm-torch][-pf-<prefill
    format>]-t<threads>.json`.

    One file per host, model, weight quantization, KV cache dtype, decode matmul and thread
    count, because a cost model is a measurement of exactly that combination: another CPU,
    model, quantization, KV dtype (it sets the bytes a decode step reads), decode matmul (it
    sets how batch size costs), prefill format (resolved: bf16x3 | bf16; it sets what a prompt
    costs) or thread count has other coefficients. (`none` and `auto` add
    nothing, so files saved before either existed keep their names; `profile._load_valid`
    still refuses one measured with another decode matmul.)
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    host = _slug(host if host is not None else platform.node())
    quant = "" if quantization == "none" else f"-{_slug(quantization)}"
    quant += "" if kv_cache_dtype == "auto" else f"-kv-{_slug(kv_cache_dtype)}"
    quant += "" if decode_matmul == "auto" else f"-mm-{_slug(decode_matmul)}"
    quant += "" if prefill_format in ("none", "auto") else f"-pf-{_slug(prefill_format)}"
    return cache_dir() / "costmodel" / f"{host}-{model_stem(model_name)}{quant}-t{threads}.json"
