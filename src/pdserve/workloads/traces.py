"""Production request traces (shared/traces/README.md), read, windowed and scaled for replay in
`pdserve bench replay` and `pdserve sim --trace`.

Formats (chosen by the content, not the file name):
  * Mooncake jsonl: one {"timestamp" (ms from the start), "input_length", "output_length",
    "hash_ids"} per line; hash_ids: one id per 512-token prompt block, equal ids meaning an
    equal prefix up to and including that block (the KV can be reused);
  * Azure LLM inference csv: TIMESTAMP (a date-time), ContextTokens, GeneratedTokens; no hashes,
    so no shared blocks;
  * a plain csv with arrival_s (or arrival_timestamp), input_tokens (or prompt_size),
    output_tokens (or token_size): the SplitwiseSim columns `pdserve sim --trace` took before.

A window is contiguous (`start_ms`, then `limit` requests), never a random subset, so bursts
survive. Scaling, as the report states it: lengths x `length_scale` with the block structure
kept (every 512-token block becomes round(512 x scale) tokens, the last, partial one its own
share), output lengths x the same factor; arrival times (from the window's first request) x
`time_scale` (2: half the rate).
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pdserve.workloads.streams import ID_HIGH, ID_LOW

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake traces
_COLUMNS = {
    "arrival": ("TIMESTAMP", "arrival_s", "arrival_timestamp", "arrival"),
    "input": ("ContextTokens", "input_tokens", "prompt_size", "input_len"),
    "output": ("GeneratedTokens", "output_tokens", "token_size", "output_len"),
}


@dataclass(frozen=True)
class Scaling:
    limit: int | None = None  # requests in the window (None: to the end)
    start_ms: float = 0.0  # the window starts at the first request at or after this
    length_scale: float = 1.0  # prompt, block and output lengths x this
    time_scale: float = 1.0  # arrival times x this (2: half the rate)

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if not (self.start_ms >= 0 and math.isfinite(self.start_ms)):
            raise ValueError(f"--start-ms must be >= 0, got {self.start_ms}")
        for name in ("length_scale", "time_scale"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {v}")

    @property
    def block_tokens(self) -> int:
        return max(1, round(TRACE_BLOCK * self.length_scale))

    def describe(self) -> str:
        n = "all" if self.limit is None else str(self.limit)
        return (
            f"window: {n} requests from {self.start_ms:g} ms; lengths x {self.length_scale:g} "
            f"({TRACE_BLOCK}-token blocks -> {self.block_tokens}); arrival times x "
            f"{self.time_scale:g} (rate / {self.time_scale:g})"
        )


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # scaled, from the window's first request
    blocks: tuple[int, ...]  # tokens per prompt block, scaled (one block when no hashes)
    hash_ids: tuple[int, ...]  # one per block; () when the trace has none (Azure)
    output_len: int  # scaled
    truncated: bool = False  # blocks or output cut to fit a context (`fit`)

    @property
    def input_len(self) -> int:
        return sum(self.blocks)


@dataclass(frozen=True)
class Trace:
    path: Path
    format: str  # mooncake | azure | csv
    scaling: Scaling
    requests: list[TraceRequest]

    def config(self) -> dict[str, object]:
        """How the trace was read and scaled, for the report and the JSON."""
        return {
            "trace": str(self.path),
            "format": self.format,
            "limit": self.scaling.limit,
            "start_ms": self.scaling.start_ms,
            "length_scale": self.scaling.length_scale,
            "time_scale": self.scaling.time_scale,
            "block_tokens": self.scaling.block_tokens,
            "requests": len(self.requests),
            "truncated": sum(r.truncated for r in self.requests),
            "scaling": self.scaling.describe(),
        }


# ---------------------------------------------------------------------------- reading


Row = tuple[float, int, int, tuple[int, ...]]  # arrival ms, input tokens, output tokens, hash ids


def _rows(path: Path) -> tuple[str, Iterator[Row]]:
    """The file's format and its rows, read lazily (a window stops reading early)."""
    try:
        with path.open(encoding="utf-8") as f:
            first = f.readline()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the trace {path}: {e}") from None
    if first.lstrip().startswith("{"):
        return "mooncake", _mooncake(path)
    return ("azure" if "TIMESTAMP" in first else "csv"), _csv(path)


def _mooncake(path: Path) -> Iterator[Row]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                row = (float(r["timestamp"]), int(r["input_length"]), int(r["output_length"]))
                ids = tuple(int(h) for h in r.get("hash_ids") or ())
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{n}: not a Mooncake trace line ({e!r})") from None
            if ids and len(ids) != math.ceil(row[1] / TRACE_BLOCK):
                raise ValueError(f"{path}:{n}: {len(ids)} hash_ids for {row[1]} tokens")
            yield (*row, ids)


def _when(text: str) -> float:
    """Seconds of a TIMESTAMP ("2023-11-16 18:17:03.9799600": 7 fraction digits, more than
    datetime parses) or a plain number of seconds."""
    try:
        return float(text)
    except ValueError:
        pass
    whole, _, frac = text.strip().partition(".")
    t = dt.datetime.fromisoformat(whole).replace(tzinfo=dt.UTC).timestamp()
    return t + (float(f"0.{frac}") if frac else 0.0)


def _csv(path: Path) -> Iterator[Row]:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames or []
        cols = {}
        for key, names in _COLUMNS.items():
            found = next((n for n in names if n in fields), None)
            if found is None:
                raise ValueError(f"{path}: no {key} column (one of {', '.join(names)})")
            cols[key] = found
        for n, row in enumerate(reader, 2):
            try:
                t = _when(row[cols["arrival"]]) * 1e3
                yield t, int(row[cols["input"]]), int(row[cols["output"]]), ()
            except (TypeError, ValueError):
                raise ValueError(f"{path}:{n}: expected a time and two token counts") from None


def read_trace(path: str | Path, scaling: Scaling) -> Trace:
    """The window of `path` that `scaling` names, scaled. `start_ms` counts from the file's
    first request (Azure: its first TIMESTAMP); the result's arrivals from the window's first."""
    path = Path(path)
    fmt, rows = _rows(path)
    picked: list[Row] = []
    t_first: float | None = None
    prev = 0.0
    for n, (t, n_in, n_out, ids) in enumerate(rows, 1):
        t_first = t if t_first is None else t_first
        rel = t - t_first
        if rel < prev or n_in < 0 or n_out < 0:
            raise ValueError(f"{path}: request {n} goes back in time or has a negative length")
        prev = rel
        if rel >= scaling.start_ms:
            picked.append((rel, n_in, n_out, ids))
            if scaling.limit is not None and len(picked) >= scaling.limit:
                break
    if not picked:
        raise ValueError(f"{path}: no request at or after {scaling.start_ms:g} ms")
    t0 = picked[0][0]
    return Trace(path, fmt, scaling, [_scaled(r, t0, scaling) for r in picked])


def _scaled(row: Row, t0: float, s: Scaling) -> TraceRequest:
    t, n_in, n_out, ids = row
    f = s.length_scale
    if ids:  # every block but the last is whole; the last holds the rest
        last = n_in - TRACE_BLOCK * (len(ids) - 1)
        blocks = (s.block_tokens,) * (len(ids) - 1) + (max(1, round(last * f)),)
    else:
        blocks = (max(1, round(n_in * f)),)
    arrival = (t - t0) / 1e3 * s.time_scale
    return TraceRequest(arrival, blocks, ids, max(1, round(n_out * f)))


def fit(req: TraceRequest, max_len: int) -> TraceRequest:
    """`req` within a context of `max_len` tokens (prompt + output): the output cut to at most
    half of it, then the prompt's tail cut (whole blocks dropped, the last kept one cut short:
    still a prefix of itself, so the shared structure before the cut stays)."""
    if req.input_len + req.output_len <= max_len:
        return req
    if max_len < 2:
        raise ValueError(f"a context of {max_len} tokens cannot hold a prompt and an answer")
    out = min(req.output_len, max_len // 2)
    room, blocks = max_len - out, []
    for n in req.blocks:
        if room <= 0:
            break
        blocks.append(min(n, room))
        room -= blocks[-1]
    ids = req.hash_ids[: len(blocks)]
    return replace(req, blocks=tuple(blocks), hash_ids=ids, output_len=out, truncated=True)


def expected_prefix_hits(requests: list[TraceRequest]) -> dict[str, float | int]:
    """The reuse the trace itself promises: for each request, in order, the prompt tokens of its
    leading blocks already seen in an earlier request of the window (an unbounded cache; a
    block seen only shorter counts as long as it was seen, and ends the match). Token-weighted:
    `prefix_hit_ratio` = those tokens / all prompt tokens; 0 for a trace without hashes."""
    seen: dict[int, int] = {}
    hit = total = 0
    for r in requests:
        total += r.input_len
        for n, h in zip(r.blocks, r.hash_ids, strict=False):
            got = min(n, seen.get(h, 0))
            hit += got
            if got < n:
                break
        for n, h in zip(r.blocks, r.hash_ids, strict=False):
            seen[h] = max(n, seen.get(h, 0))
    return {
        "prefix_hit_ratio": hit / total if total else 0.0,
        "prefix_hit_tokens": hit,
        "prompt_tokens": total,
    }


# ---------------------------------------------------------------------------- prompts


def block_keys(req: TraceRequest, index: int) -> list[tuple[int, int]]:
    """What each block's content is drawn from: its hash id (shared wherever the id repeats),
    or, for a trace without hashes, the request's own index (a prompt shared with no one)."""
    if req.hash_ids:
        return [(0, h) for h in req.hash_ids]
    return [(1, index)]


def block_draw(key: tuple[int, int], n: int, high: int, seed: int) -> np.ndarray:
    """`n` numbers in [0, high) fixed by (`seed`, `key`): the same key always gives the same
    numbers (a shorter block is a prefix of the longer), different keys independent ones."""
    if min(key) < 0:
        raise ValueError(f"block keys are >= 0, got {key}")
    return np.random.default_rng([seed, *key]).integers(0, high, size=n)


# Shared int objects: a million-token prompt built from them costs its list (8 bytes a token),
# not a new int per token (full-scale simulations hold every prompt of an hour-long trace).
_IDS = np.arange(ID_LOW, ID_HIGH, dtype=np.int64).astype(object)


def prompt_ids(req: TraceRequest, index: int, seed: int) -> list[int]:
    """The prompt as token ids (ID_LOW..ID_HIGH): each block `block_draw`n from its key."""
    out: list[int] = []
    for n, key in zip(req.blocks, block_keys(req, index), strict=True):
        out += _IDS[block_draw(key, n, len(_IDS), seed)].tolist()
    return out
