"""argparse `type=` converters shared by every command line (bench, plan): each refuses bad
input with a message naming what it expected, so argparse exits with a usage error."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def _fail(what: str, text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"expected {what}, got {text!r}")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise _fail("a positive integer", text)
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise _fail("an integer >= 0", text)
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise _fail("a positive number", text)
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise _fail("a number >= 0", text)
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise _fail("a number in [0, 1]", text)
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers: `1,2,4`."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise _fail("comma-separated integers", text) from None
    if not values or any(v < 1 for v in values):
        raise _fail("positive integers", text)
    return values


def float_list(text: str) -> list[float]:
    """Comma-separated positive numbers: `0.5,1,2`."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise _fail("comma-separated numbers", text) from None
    if not values or any(not v > 0 for v in values):
        raise _fail("positive numbers", text)
    return values


def subset(allowed: Iterable[str]) -> Callable[[str], list[str]]:
    """A converter for a comma-separated subset of `allowed` (order kept, repeats dropped)."""
    known = list(allowed)

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names or any(n not in known for n in names):
            raise _fail(f"a comma-separated subset of {','.join(known)}", text)
        return list(dict.fromkeys(names))

    return parse
