"""config.strict_json: the JSON every file and endpoint of the project is written with parses under JSON.parse's
rules (no NaN, no Infinity), a non-finite number spelled as a string, and a metrics record reads back as numbers."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from conftest import strict_json_loads
from gaudi3_scale.config.strict_json import dumps, restore_non_finite

NAN, INF = float("nan"), float("inf")


def test_non_finite_numbers_are_spelled_out_at_any_depth() -> None:
    value = {
        "loss": NAN,
        "per_rank": [1.0, INF, (-INF, 2)],
        "nested": {"grad_norm": [{"x": NAN}]},
        "name": "NaN",
    }
    assert strict_json_loads(dumps(value)) == {
        "loss": "NaN", "per_rank": [1.0, "Infinity", ["-Infinity", 2]], "nested": {"grad_norm": [{"x": "NaN"}]},
        "name": "NaN",
    }  # fmt: skip
    assert math.isnan(value["loss"])  # the caller's object is left as it was


def test_finite_values_are_written_as_json_dumps_writes_them() -> None:
    value = {"step": 3, "loss": 1.25, "ok": True, "none": None, "text": "é", "rows": [[1, 2.5e-9]]}
    for options in ({}, {"indent": 2}, {"separators": (",", ":"), "sort_keys": True, "ensure_ascii": False}):
        assert dumps(value, **options) == json.dumps(value, **options)


@dataclass
class _Point:
    x: float


def test_what_default_makes_of_an_object_is_spelled_out_too() -> None:
    def default(obj: Any) -> Any:
        return {"x": obj.x}

    assert strict_json_loads(dumps({"p": _Point(NAN), "q": NAN}, default=default)) == {
        "p": {"x": "NaN"},
        "q": "NaN",
    }


def test_a_metrics_record_reads_back_as_numbers() -> None:
    written = {"step": 4, "train_loss": NAN, "grad_norm": INF, "lr": -INF, "mfu": None, "tokens_per_s": 10.0}
    record = restore_non_finite(strict_json_loads(dumps(written)))
    assert math.isnan(record["train_loss"]) and record["grad_norm"] == INF and record["lr"] == -INF
    assert (record["step"], record["mfu"], record["tokens_per_s"]) == (4, None, 10.0)
