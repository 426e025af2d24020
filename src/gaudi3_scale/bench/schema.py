"""The benchmark result schema: one JSON object per cell, written by the cell's rank 0 or by the matrix runner.

Version 1 (`schema_version: 1`, `schema: "gaudi3-scale/benchmark-result"`). Units are in the field names.

    {
      "schema": "gaudi3-scale/benchmark-result",
      "schema_version": 1,
      "cell": {                          # what ran
        "id": str,                       #   stable key of the cell (strategy, ranks, model, micro-batch, precision);
                                         #   one plain path component (config.core.check_name): it names cells/<id>/
        "matrix": str | null,            #   the matrix it belongs to
        "model": str,                    #   registry preset
        "strategy": str,                 #   parallel.strategy as resolved (auto → ddp/single)
        "world_size": int, "nnodes": int,
        "micro_batch_size": int,         #   sequences per rank per forward pass
        "global_batch_size": int,        #   sequences per optimizer step, all ranks
        "accumulation": int,
        "context_length": int,           #   tokens per sequence
        "precision": str,                #   as resolved (auto → 32-true / bf16-mixed)
        "data": str                      #   "synthetic" or the data source
      },
      "status": "ok" | "failed" | "oom" | "timeout",
      "reason": str,                     # why it ended ("" when ok)
      "metrics": {                       # null unless status is "ok"
        "tokens_per_s": float,           #   global tokens per second over the measured steps
        "samples_per_s": float,          #   global sequences per second
        "step_time_s": {"mean": float, "p50": float, "p95": float, "n": int},
        "peak_memory_bytes_per_rank": [int, …],   # CPU: peak RSS; CUDA: max allocated; HPU: max in use
        "peak_memory_bytes": int,        #   the largest of them
        "h2d_gbps": float | null,        #   pinned host→device copy, GB/s (1e9); null on CPU (no device memory)
        "mean_loss": float,              #   mean train loss over the measured steps
        "mfu": float | null,             #   model FLOPs utilization (0–1) vs the device peak; null if unknown
        "scaling_efficiency": float | null  # tokens/s ÷ (world_size × the 1-rank cell's tokens/s); null without one
      },
      "steps": {"warmup": int, "measured": int},
      "environment": {…},                # monitor.environment.environment_info(): hardware, versions, git commit
      "created": str                     # ISO 8601 with a UTC offset: which of two copies of a result is newer
    }
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from gaudi3_scale.config.core import check_name
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.config.files import load_json_file
from gaudi3_scale.monitor.perf import mfu_above_peak

__all__ = [
    "RESULT_SCHEMA",
    "RESULT_SCHEMA_VERSION",
    "STATUSES",
    "created_time",
    "load_result",
    "mfu_problem",
    "validate_result",
]

RESULT_SCHEMA = "gaudi3-scale/benchmark-result"
RESULT_SCHEMA_VERSION = 1
STATUSES = ("ok", "failed", "oom", "timeout")

_CELL_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "matrix": (str, type(None)),
    "model": str,
    "strategy": str,
    "world_size": int,
    "nnodes": int,
    "micro_batch_size": int,
    "global_batch_size": int,
    "accumulation": int,
    "context_length": int,
    "precision": str,
    "data": str,
}
_NUMBER = (int, float)
_METRIC_FIELDS: dict[str, type | tuple[type, ...]] = {
    "tokens_per_s": _NUMBER,
    "samples_per_s": _NUMBER,
    "step_time_s": dict,
    "peak_memory_bytes_per_rank": list,
    "peak_memory_bytes": int,
    "h2d_gbps": (*_NUMBER, type(None)),
    "mean_loss": _NUMBER,
    "mfu": (*_NUMBER, type(None)),
    "scaling_efficiency": (*_NUMBER, type(None)),
}


def _type_name(expected: type | tuple[type, ...]) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    names = {"int": "integer", "float": "number", "str": "string", "NoneType": "null", "dict": "object",
             "list": "array"}  # fmt: skip
    words = list(dict.fromkeys(names.get(t.__name__, t.__name__) for t in types))
    if "number" in words and "integer" in words:
        words.remove("integer")  # every integer is a number
    return " or ".join(words)


def _check(obj: dict[str, Any], fields: dict[str, type | tuple[type, ...]], where: str, source: str) -> None:
    for name, expected in fields.items():
        if name not in obj:
            raise UserInputError(f"{source}: {where}{name} is missing")
        value = obj[name]
        bad_bool = isinstance(value, bool)  # bool is an int to Python, never to this schema
        if bad_bool or not isinstance(value, expected):
            raise UserInputError(
                f"{source}: {where}{name} must be {_type_name(expected)}, got {json.dumps(value)[:60]}"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise UserInputError(f"{source}: {where}{name} must be a finite number, got {value}")


def validate_result(obj: Any, source: str) -> dict[str, Any]:
    """`obj` if it is a valid version-1 result; else UserInputError naming `source` and the first bad field."""
    if not isinstance(obj, dict):
        raise UserInputError(f"{source}: a benchmark result must be a JSON object, got {type(obj).__name__}")
    if obj.get("schema") != RESULT_SCHEMA:
        raise UserInputError(f"{source}: not a benchmark result (schema is {obj.get('schema')!r}, "
                             f"expected {RESULT_SCHEMA!r})")  # fmt: skip
    if obj.get("schema_version") != RESULT_SCHEMA_VERSION:
        raise UserInputError(f"{source}: schema_version {obj.get('schema_version')!r} is not supported "
                             f"(this version reads {RESULT_SCHEMA_VERSION})")  # fmt: skip
    _check(obj, {"cell": dict, "status": str, "reason": str, "steps": dict, "environment": dict,
                 "created": str}, "", source)  # fmt: skip
    if obj["status"] not in STATUSES:
        raise UserInputError(f"{source}: status must be one of {', '.join(STATUSES)}, got {obj['status']!r}")
    created_time(obj, source)
    _check(obj["cell"], _CELL_FIELDS, "cell.", source)
    try:
        check_name("cell.id", obj["cell"]["id"])  # it becomes OUT/cells/<id>/: never `..`, `/abs` or `a/b`
    except ConfigError as exc:
        raise UserInputError(f"{source}: {exc}") from None
    for name in (
        "world_size",
        "nnodes",
        "micro_batch_size",
        "global_batch_size",
        "accumulation",
        "context_length",
    ):
        if obj["cell"][name] < 1:
            raise UserInputError(f"{source}: cell.{name} must be at least 1, got {obj['cell'][name]}")
    _check(obj["steps"], {"warmup": int, "measured": int}, "steps.", source)
    metrics = obj.get("metrics")
    if obj["status"] != "ok":
        if metrics is not None:
            raise UserInputError(f"{source}: metrics must be null when status is {obj['status']!r}")
        return obj
    if not isinstance(metrics, dict):
        raise UserInputError(f"{source}: metrics must be an object when status is 'ok'")
    _check(metrics, _METRIC_FIELDS, "metrics.", source)
    _check(metrics["step_time_s"], {"mean": _NUMBER, "p50": _NUMBER, "p95": _NUMBER, "n": int},
           "metrics.step_time_s.", source)  # fmt: skip
    per_rank = metrics["peak_memory_bytes_per_rank"]
    if len(per_rank) != obj["cell"]["world_size"] or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in per_rank
    ):
        raise UserInputError(
            f"{source}: metrics.peak_memory_bytes_per_rank must hold one non-negative integer per rank "
            f"({obj['cell']['world_size']}), got {json.dumps(per_rank)[:60]}"
        )
    for name in ("tokens_per_s", "samples_per_s"):
        if metrics[name] <= 0:
            raise UserInputError(f"{source}: metrics.{name} must be positive, got {metrics[name]}")
    above = mfu_problem(metrics["mfu"], obj["environment"])
    if above:
        raise UserInputError(f"{source}: metrics.mfu must be at most 1: {above}")
    return obj


def created_time(result: dict[str, Any], source: str = "benchmark result") -> datetime:
    """When `result` was made: its `created`, an ISO 8601 time with a UTC offset (a naive time cannot be ordered
    against another machine's)."""
    text = result["created"]
    try:
        created = datetime.fromisoformat(text)
    except ValueError:
        created = None
    if created is None or created.utcoffset() is None:
        raise UserInputError(
            f"{source}: created must be an ISO 8601 time with a UTC offset (2026-01-02T03:04:05+00:00), "
            f"got {json.dumps(text)[:60]}"
        )
    return created


def mfu_problem(mfu: float | None, environment: dict[str, Any] | None) -> str | None:
    """Why a result's MFU is not a result, or None. Against a GPU's datasheet peak an MFU above 1 is a measuring bug.
    On CPU the peak is itself measured (it comes out low when the machine was busy), and Gaudi is not yet validated
    on Gaudi hardware: neither is checked."""
    return mfu_above_peak(mfu) if (environment or {}).get("cuda") else None


def load_result(path: Path) -> dict[str, Any]:
    """Read and validate one result file; every problem is one UserInputError line naming the file."""
    obj = load_json_file(path, what="benchmark result", expect=None)
    return validate_result(obj, str(path))
