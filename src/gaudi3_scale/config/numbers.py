"""The one numeric validator: every config field and every CLI number goes through `check_number`.

A number from a user is refused, with one line naming the field, when it is

* not finite (NaN passes every ``> 0`` test, so it is checked first; infinity and ``1e400`` are refused alike),
* an integer outside 64 bits (it reaches torch, numpy or the OS somewhere; ``1e300`` steps is a typo, not a plan),
* outside the field's own range (a seed must be in [0, 2**32), numpy's range),
* or, as text, an integer of more than `MAX_INT_DIGITS` digits (Python refuses to convert 4,300 or more, and no
  number we read has more than 20).

Durations are bounded too (`MAX_SECONDS`): the OS timers behind a ``timeout`` overflow somewhere above 2**63 ns.
"""

from __future__ import annotations

import math
import re
from typing import Any

from gaudi3_scale.config.errors import ConfigError, brief

__all__ = [
    "INT32_MAX",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_GLOBAL_BATCH_SIZE",
    "MAX_INT_DIGITS",
    "MAX_SECONDS",
    "SEED_LIMIT",
    "check_number",
    "check_positive",
    "check_range",
    "check_seconds",
    "check_seed",
    "finite_number",
    "is_number",
    "is_number_text",
    "parse_number",
]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1  # counts handed to C ints: threads, processes
MAX_WORLD_SIZE = (
    2**20
)  # ranks (or nodes) a plan, tuner or cost estimate takes: estimates keep a figure per rank
# Sequences per optimizer step the tuner searches: 512× Llama 3 405B's largest batch, 16M tokens = 2,048 sequences
# of 8,192 ("The Llama 3 Herd of Models", 2024, §3.4.1).
MAX_GLOBAL_BATCH_SIZE = 2**20
SEED_LIMIT = 2**32  # numpy.random.default_rng / RandomState take seeds in [0, 2**32)
MAX_INT_DIGITS = 100  # characters of an integer literal, sign and underscores included
MAX_SECONDS = 10.0**9  # ~31.7 years; threading.TIMEOUT_MAX is ~9.2e9 s on Linux

_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_FLOAT_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def check_number(
    name: str,
    value: float | int | None,
    *,
    low: float | None = None,
    high: float | None = None,
    above: float | None = None,
) -> None:
    """Refuse a non-finite number, an integer outside 64 bits, or one outside [low, high] / (above, high].

    `None` passes: optional fields say "null = default". Raises `ConfigError(name, …)`.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(name, f"expected a number, got {brief(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number, got {value}")
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        raise ConfigError(name, f"must fit in 64 bits (at most {INT64_MAX:,}), got {brief(value)}")
    if above is not None and not value > above:
        raise ConfigError(name, f"must be > {_bound(above)}, got {brief(value)}")
    if low is not None and not value >= low:
        raise ConfigError(name, f"must be >= {_bound(low)}, got {brief(value)}")
    if high is not None and not value <= high:
        raise ConfigError(name, f"must be <= {_bound(high)}, got {brief(value)}")


def _bound(bound: float) -> str:
    """An integer bound as the integer (2147483647, which `:g` shows as 2.14748e+09), a float one with `:g`."""
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def check_positive(name: str, value: float | int | None, *, allow_zero: bool = False) -> None:
    """Finite and > 0 (or >= 0 with `allow_zero`); None passes."""
    if allow_zero:
        check_number(name, value, low=0)
    else:
        check_number(name, value, above=0)


def check_range(name: str, value: float | None, low: float, high: float) -> None:
    """Finite and in [low, high]; None passes."""
    check_number(name, value)
    if value is not None and not low <= value <= high:
        raise ConfigError(name, f"must be between {low} and {high}, got {brief(value)}")


def check_seed(name: str, value: int | None) -> None:
    """A seed numpy and torch both take: an integer in [0, 2**32)."""
    check_number(name, value)
    if value is not None and not (isinstance(value, int) and 0 <= value < SEED_LIMIT):
        raise ConfigError(
            name, f"must be an integer from 0 to {SEED_LIMIT - 1:,} (2**32 - 1), got {brief(value)}"
        )


def check_seconds(name: str, value: float | None, *, allow_zero: bool = False) -> None:
    """A duration: finite, > 0 (or >= 0), at most `MAX_SECONDS`."""
    check_positive(name, value, allow_zero=allow_zero)
    check_number(name, value, high=MAX_SECONDS)


def is_number(value: Any) -> bool:
    """Whether a parsed JSON or YAML value is a number (NaN and the infinities included; a bool is not one)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def finite_number(value: Any) -> float | None:
    """A parsed value as a finite float; None for anything else (null, text, a bool, NaN, an infinity): how readers
    of files written by hand, by another tool or by an older version take a figure they show or compute with."""
    return float(value) if is_number(value) and math.isfinite(value) else None


def is_number_text(text: str) -> bool:
    """A plain decimal number in ASCII (`3`, `-0.5`, `1e-3`): what `float()` takes, minus nan, inf, `1_000` and
    other scripts' digits (`float('١٢')` is 12.0)."""
    return bool(_FLOAT_TEXT.fullmatch(text.strip()))


def parse_number(name: str, text: str, *, integer: bool) -> int | float:
    """A number typed on the command line: ASCII digits only, at most `MAX_INT_DIGITS` for an integer.

    ``int()`` alone would take ``'١٢'`` (Arabic-Indic digits) and ``'1_000'``, and raise a bare ValueError for
    4,300 digits; ``float()`` would take ``'nan'`` and ``'infinity'``. Range checks are `check_number`'s.
    """
    text = text.strip()
    if integer:
        if not _INT_TEXT.fullmatch(text):
            raise ConfigError(name, f"expected a whole number, got {brief(text)}")
        if len(text) > MAX_INT_DIGITS:
            raise ConfigError(
                name, f"an integer of {len(text):,} characters; at most {MAX_INT_DIGITS} are read"
            )
        return int(text)
    if not _FLOAT_TEXT.fullmatch(text):
        raise ConfigError(name, f"expected a finite number such as 3, 0.5 or 1e-3, got {brief(text)}")
    value = float(text)
    check_number(name, value)
    return value
