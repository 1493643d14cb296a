"""Settings from `PIPELINE_*` variables and the launcher's flags, parsed by one rule.

The rule, for every one of them: unset and empty mean the same (the default); a number is
written as an integer or in decimal or float notation (`300`, `2.5`, `1e9`), must be finite
and within its range, and a whole number where a count is meant (exactly: `4e18 + 0.5` is
not rounded to one); a choice is one of its listed values. Anything else raises
`PipeConfigError` naming the setting, the value seen, what is allowed, and how to unset it.
"""

from __future__ import annotations

import argparse
import decimal
import os
from collections.abc import Callable, Mapping
from typing import overload

from pipeline.errors import PipeConfigError

__all__ = ["choice", "flag", "number", "parse_number", "whole_number"]


def _raw(name: str, environ: Mapping[str, str] | None) -> str | None:
    """The variable's text, None when it is unset or empty (the two mean the same)."""
    value = (os.environ if environ is None else environ).get(name)
    return value if value is not None and value.strip() else None


def _decimal(name: str, raw: str, allowed: str) -> decimal.Decimal:
    try:
        value = decimal.Decimal(raw.strip())
    except decimal.InvalidOperation:
        value = decimal.Decimal("nan")
    if not value.is_finite():
        raise PipeConfigError(f"{name} must be {allowed}; got {raw!r}: set such a number, or "
                              f"unset it for the default")
    return value


def parse_number(name: str, raw: str, *, low: float, high: float, unit: str = "") -> float:
    """`raw` as a finite number from `low` to `high` (inclusive), for setting `name`."""
    allowed = f"a finite number from {low:g} to {high:g}{unit}"
    value = _decimal(name, raw, allowed)
    if not decimal.Decimal(repr(low)) <= value <= decimal.Decimal(repr(high)):
        raise PipeConfigError(f"{name} must be {allowed}; got {raw!r}: set such a number, or "
                              f"unset it for the default")
    return float(value)


@overload
def number(name: str, *, default: float, low: float, high: float, unit: str = "",
           environ: Mapping[str, str] | None = None) -> float: ...


@overload
def number(name: str, *, default: None, low: float, high: float, unit: str = "",
           environ: Mapping[str, str] | None = None) -> float | None: ...


def number(name: str, *, default: float | None, low: float, high: float, unit: str = "",
           environ: Mapping[str, str] | None = None) -> float | None:
    """Variable `name` as a finite number from `low` to `high`, or `default` if unset."""
    raw = _raw(name, environ)
    return default if raw is None else parse_number(name, raw, low=low, high=high, unit=unit)


def whole_number(name: str, *, default: int | None, low: int, high: int, of: str = "",
                 high_text: str | None = None,
                 environ: Mapping[str, str] | None = None) -> int | None:
    """Variable `name` as a whole number (`of` bytes, say) from `low` to `high` (exactly: no
    rounding), or `default` if unset. `high_text` shows the bound (`2**62`)."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    allowed = (f"a whole number{' of ' + of if of else ''} from {low} to {high_text or high} "
               f"(an integer or float notation such as 1e9)")
    value = _decimal(name, raw, allowed)
    if value != value.to_integral_value() or not low <= value <= high:
        raise PipeConfigError(f"{name} must be {allowed}; got {raw!r}: set such a number, or "
                              f"unset it for the default")
    return int(value)


def flag(name: str, *, low: float, high: float, unit: str = "") -> Callable[[str], float]:
    """An argparse `type` for flag `name`: the same rule as for a variable (argparse then
    names the flag and exits with its usage)."""

    def parse(raw: str) -> float:
        try:
            return parse_number(name, raw, low=low, high=high, unit=unit)
        except PipeConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def choice(name: str, values: Mapping[str, str], *, default: str,
           environ: Mapping[str, str] | None = None) -> str:
    """Variable `name` as one of `values` (value -> what it means), or `default` if unset."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    if raw.strip() not in values:
        listed = ", ".join(f"{v} ({meaning})" for v, meaning in values.items())
        raise PipeConfigError(f"{name} must be one of {listed}; got {raw!r}: set one of these, "
                              f"or unset it for {default}")
    return raw.strip()
