"""A cell's result: computed by its rank 0 from the run's per-step metrics, written as JSON, printed for log collection.

Stdout carries the result between fixed markers so `gaudi3 benchmark collect` can recover it from pod logs, where
other ranks' lines interleave with it and log shippers may prefix every line (timestamps, pod names):

    GAUDI3-BENCHMARK-RESULT-BEGIN <cell-id> <chunks> <sha256 of the JSON>
    GAUDI3-BENCHMARK-RESULT <cell-id> <i> <base64 chunk of the JSON>      (i = 0 … chunks-1)
    GAUDI3-BENCHMARK-RESULT-END <cell-id>

Every line is written with one `write` of less than PIPE_BUF bytes, so lines from other processes on the same pipe
land between these lines, never inside one; base64 survives trailing-whitespace trimming; the hash catches a chunk
that was lost or mangled anyway.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from gaudi3_scale.bench.schema import RESULT_SCHEMA, RESULT_SCHEMA_VERSION, mfu_problem, validate_result
from gaudi3_scale.config.atomic import write_text_atomic
from gaudi3_scale.distributed.plan import BatchPlan

__all__ = [
    "BEGIN",
    "CHUNK",
    "END",
    "RESULT_FILE",
    "WORKLOAD_FIELDS",
    "cell_result_path",
    "cell_section",
    "failed_result",
    "keep_good_entry",
    "load_stored_results",
    "measure_h2d_gbps",
    "print_result",
    "result_from_metrics",
    "write_json_atomic",
    "write_result",
]

BEGIN = "GAUDI3-BENCHMARK-RESULT-BEGIN"
CHUNK = "GAUDI3-BENCHMARK-RESULT"
END = "GAUDI3-BENCHMARK-RESULT-END"
RESULT_FILE = "benchmark_result.json"
CHUNK_CHARS = 2048  # < PIPE_BUF (4096) with the prefix: one atomic write per line
# What a result's `cell` records of the work it measured beyond its id's axes (model, strategy, ranks, micro-batch,
# precision): two results measured the same work only where these match too (a reused result, a cross-set ratio).
WORKLOAD_FIELDS = ("nnodes", "global_batch_size", "accumulation", "context_length", "data")


def cell_result_path(out_dir: Path, cell_id: str) -> Path:
    """Where a results directory keeps a cell's result (the layout in `bench.runner`); `cell_id` is a plain name,
    as every validated result's is (`bench.schema`)."""
    return out_dir / "cells" / cell_id / "result.json"


def cell_section(
    *,
    cell_id: str,
    matrix: str | None,
    model: str,
    strategy: str,
    world_size: int,
    nnodes: int,
    batch: BatchPlan,
    precision: str,
    data: str,
) -> dict[str, Any]:
    """The result's `cell`: what ran on `world_size` ranks (every rank; under tensor parallel, more than the
    data-parallel ranks `batch` splits each step over) and that split."""
    return {
        "id": cell_id,
        "matrix": matrix,
        "model": model,
        "strategy": strategy,
        "world_size": world_size,
        "nnodes": nnodes,
        "micro_batch_size": batch.micro_batch_size,
        "global_batch_size": batch.global_batch_size,
        "accumulation": batch.accumulation,
        "context_length": batch.context_length,
        "precision": precision,
        "data": data,
    }


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def result_from_metrics(
    cell: dict[str, Any],
    records: Sequence[dict[str, Any]],
    *,
    warmup_steps: int,
    h2d_gbps: float | None,
    environment: dict[str, Any],
) -> dict[str, Any]:
    """The result of a finished cell from its metrics.jsonl records (one per step); steps ≤ warmup_steps are left out.

    tokens/s and samples/s are the global batch over the mean step time of the measured steps; MFU is scaled from
    the per-step value (same model, same peak) to that tokens/s.
    """
    steps = [r for r in records if r.get("train_loss") is not None and r.get("step_time_s")]
    measured = [r for r in steps if r["step"] > warmup_steps]
    base = _envelope(cell, warmup_steps, len(measured), environment)
    if not measured:
        return {**base, "status": "failed", "reason": f"no measured steps after {warmup_steps} warm-up steps",
                "metrics": None}  # fmt: skip
    times = sorted(float(r["step_time_s"]) for r in measured)
    mean_s = statistics.fmean(times)
    tokens_per_s = cell["global_batch_size"] * cell["context_length"] / mean_s
    per_rank = [
        max(int(r["peak_memory_bytes_per_rank"][i]) for r in steps) for i in range(cell["world_size"])
    ]
    mfu_rows = [r for r in measured if r.get("mfu") and r.get("tokens_per_s")]
    mfu = (
        statistics.fmean(r["mfu"] / r["tokens_per_s"] for r in mfu_rows) * tokens_per_s if mfu_rows else None
    )
    above = mfu_problem(mfu, environment)
    if above:  # a measuring bug, not a result: the cell fails with the reason
        return {**base, "status": "failed", "reason": above, "metrics": None}
    metrics = {
        "tokens_per_s": tokens_per_s,
        "samples_per_s": cell["global_batch_size"] / mean_s,
        "step_time_s": {
            "mean": mean_s,
            "p50": _percentile(times, 0.5),
            "p95": _percentile(times, 0.95),
            "n": len(times),
        },
        "peak_memory_bytes_per_rank": per_rank,
        "peak_memory_bytes": max(per_rank),
        "h2d_gbps": h2d_gbps,
        "mean_loss": statistics.fmean(float(r["train_loss"]) for r in measured),
        "mfu": mfu,
        "scaling_efficiency": 1.0 if cell["world_size"] == 1 else None,  # filled by the matrix runner
    }
    return {**base, "status": "ok", "reason": "", "metrics": metrics}


def failed_result(
    cell: dict[str, Any], status: str, reason: str, *, warmup_steps: int, environment: dict[str, Any]
) -> dict[str, Any]:
    return {
        **_envelope(cell, warmup_steps, 0, environment),
        "status": status,
        "reason": reason,
        "metrics": None,
    }


def _envelope(
    cell: dict[str, Any], warmup: int, measured: int, environment: dict[str, Any]
) -> dict[str, Any]:
    return {
        "schema": RESULT_SCHEMA,
        "schema_version": RESULT_SCHEMA_VERSION,
        "cell": cell,
        "status": "ok",
        "reason": "",
        "metrics": None,
        "steps": {"warmup": warmup, "measured": measured},
        "environment": environment,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def measure_h2d_gbps(device: Any, *, size_bytes: int = 256 * 2**20, repeats: int = 5) -> float | None:
    """Pinned host → device copy bandwidth in GB/s (1e9 bytes), best of `repeats`; None on CPU (no device memory)."""
    import torch

    from gaudi3_scale.monitor.clock import DeviceClock

    if device.type == "cpu":
        return None
    cuda = device.type == "cuda"  # hpu: not yet validated on Gaudi hardware
    host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=cuda)  # page-locked: DMA at full speed
    target = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    clock = DeviceClock(device)
    target.copy_(host, non_blocking=True)
    best = math.inf
    for _ in range(repeats):
        started = clock.now()
        target.copy_(host, non_blocking=True)
        best = min(best, clock.now() - started)
    return size_bytes / best / 1e9


def write_result(result: dict[str, Any], path: Path) -> None:
    """Validate, then write atomically (temp file + rename): a reader never sees half a result."""
    validate_result(result, str(path))
    write_json_atomic(path, result)


def print_result(result: dict[str, Any], stream: TextIO | None = None) -> None:
    """The result between markers, one atomic write per line (see the module docstring)."""
    out = stream if stream is not None else sys.stdout
    text = json.dumps(result, separators=(",", ":"), sort_keys=True)
    encoded = base64.b64encode(text.encode()).decode()
    chunks = [encoded[i : i + CHUNK_CHARS] for i in range(0, len(encoded), CHUNK_CHARS)] or [""]
    cell_id = result["cell"]["id"]
    digest = hashlib.sha256(text.encode()).hexdigest()
    lines = [f"{BEGIN} {cell_id} {len(chunks)} {digest}"]
    lines += [f"{CHUNK} {cell_id} {i} {chunk}" for i, chunk in enumerate(chunks)]
    lines.append(f"{END} {cell_id}")
    out.flush()
    for line in lines:
        if out is sys.stdout:
            os.write(sys.stdout.fileno(), (line + "\n").encode())
        else:
            out.write(line + "\n")
    out.flush()


# The benchmark scripts' results files (benchmarks/results/*.json), merged by cell or shape over several runs.


def write_json_atomic(path: Path, data: Any, *, indent: int = 2) -> None:
    """`data` as JSON, written atomically (temp file + rename): a run killed mid-write (SIGKILL at a time limit)
    leaves the previous file whole, never a truncated one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=indent, default=str) + "\n")


def load_stored_results(path: Path, empty: dict[str, Any]) -> dict[str, Any]:
    """The results stored at `path` to merge a run into, or `empty` when there is no file. A file that is not a
    JSON object raises ValueError naming it: it is never silently replaced (fix or move it by hand)."""
    if not path.is_file():
        return empty
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"cannot merge into {path}: not readable JSON ({err}); move it away or pick another --out"
        ) from None
    if not isinstance(stored, dict):
        raise ValueError(f"cannot merge into {path}: not a JSON object; move it away or pick another --out")
    return stored


def keep_good_entry(
    table: dict[str, Any], name: str, new: dict[str, Any], ok: Callable[[dict[str, Any]], bool]
) -> bool:
    """Store `new` as `table[name]`, unless it did not run well (`ok` false) and the stored entry did: then the
    stored measurement stays and `new` is appended to its `failed_attempts` (said on stderr). Returns whether
    `new` was stored."""
    old = table.get(name)
    if ok(new) or not (isinstance(old, dict) and ok(old)):
        table[name] = new
        return True
    old.setdefault("failed_attempts", []).append(new)
    print(f"{name}: this run did not finish well; kept the stored result, this attempt is under failed_attempts",
          file=sys.stderr)  # fmt: skip
    return False
