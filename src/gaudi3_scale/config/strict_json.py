"""The one writer of JSON: what every file and endpoint of the project emits parses with a strict parser.

Python's `json.dumps` writes a NaN or infinite float as the bare tokens ``NaN`` / ``Infinity``, which RFC 8259 does
not have: a browser's ``JSON.parse``, jq, Go and Rust refuse the whole document. A diverged run is exactly where
they appear (``train_loss`` NaN), and exactly the run a user wants to inspect. Here a non-finite number is written
as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``: the spelling of the protobuf JSON mapping for float
fields (https://protobuf.dev/programming-guides/json/). A string keeps "it diverged" apart from null, which the
project already writes for "not measured" (no MFU without a FLOPs count); the dashboard's charts draw it as a gap
with a marker (dashboard/static/charts.js). `restore_non_finite` turns a metrics record read back into numbers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

__all__ = ["NON_FINITE", "dumps", "non_finite_name", "restore_non_finite", "spell_non_finite"]

NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}  # as written → the float


def non_finite_name(value: float) -> str:
    """How a NaN or infinite `value` is written: "NaN", "Infinity" or "-Infinity"."""
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def spell_non_finite(value: Any) -> Any:
    """A copy of `value` with every non-finite float in it (in dicts, lists and tuples, at any depth) as its name."""
    if isinstance(value, float):
        return value if math.isfinite(value) else non_finite_name(value)
    if isinstance(value, dict):
        return {key: spell_non_finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [spell_non_finite(item) for item in value]
    return value


def dumps(value: Any, *, default: Callable[[Any], Any] | None = None, **kwargs: Any) -> str:
    """`json.dumps(value, **kwargs)`, with non-finite numbers written as their names (also those in what `default`
    makes of an object). Finite data is written exactly as `json.dumps` writes it, at its speed: the walk that
    spells names runs only once the encoder has met a non-finite number."""
    try:
        return json.dumps(value, allow_nan=False, default=default, **kwargs)
    except ValueError:  # "Out of range float values are not JSON compliant" (or a cycle, raised again below)
        spelled = None if default is None else (lambda obj: spell_non_finite(default(obj)))
        return json.dumps(spell_non_finite(value), allow_nan=False, default=spelled, **kwargs)


def restore_non_finite(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics record (a flat object of numbers) as written → its values as floats again: a value spelled "NaN",
    "Infinity" or "-Infinity" is that number (a file written before this encoder holds the bare tokens, which
    `json.loads` already reads as floats). Only for records: elsewhere such a string may be text (a run's name)."""
    return {key: NON_FINITE[value] if isinstance(value, str) and value in NON_FINITE else value
            for key, value in record.items()}  # fmt: skip
