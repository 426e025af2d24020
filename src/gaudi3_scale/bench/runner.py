"""`gaudi3 benchmark run`: every cell of a matrix as its own supervised training job, results as JSON per cell.

Layout of the output directory:

    DIR/matrix.yaml                      the matrix as run
    DIR/cells/<cell-id>/cell.yaml        the cell's run config (what `gaudi3 train --config` or a pod runs)
    DIR/cells/<cell-id>/train.log        everything its ranks printed
    DIR/cells/<cell-id>/run/             its run directory (metrics.jsonl, summary.json, benchmark_result.json)
    DIR/cells/<cell-id>/result.json      the cell's result (`bench.schema`), also for failed cells

A cell with a valid result is skipped when the matrix runs again (resume); `retry_failed` re-runs failed ones. A
failed, out-of-memory or timed-out cell is recorded with its reason and the matrix goes on. When every cell has
run, scaling efficiency is filled in against the 1-rank cell of the same model, strategy, micro-batch and precision.

A directory holds one matrix's results. Before anything is written, `check_results_dir` refuses one whose
matrix.yaml is another matrix (any key differs), or that holds a result the cell of the same id would not have
produced (its matrix, batch, context length, data or steps differ: results collected from logs into it, say):
resuming would report those numbers as this matrix's.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gaudi3_scale.bench.cell import cell_of_config, cell_warmup_steps
from gaudi3_scale.bench.collect import collect_from_lines
from gaudi3_scale.bench.matrix import Cell, MatrixConfig
from gaudi3_scale.bench.result import WORKLOAD_FIELDS, cell_result_path, failed_result, write_result
from gaudi3_scale.bench.schema import load_result
from gaudi3_scale.config.core import load_yaml, save_yaml, to_dict
from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.distributed.jobs import run_job

__all__ = ["MatrixOutcome", "check_results_dir", "run_matrix"]

_STATUS = {"crash": "failed", "oom": "oom", "timeout": "timeout"}
# What a result records of the cell that made it, beyond its id (which names model, strategy, ranks, micro-batch and
# precision as asked; the result holds strategy and precision as resolved): these must match for it to be reused.
_SAME_CELL = ("id", "matrix", *WORKLOAD_FIELDS)


@dataclass(frozen=True)
class MatrixOutcome:
    results: dict[str, dict[str, Any]]  # cell id → result
    ran: list[str]
    skipped: list[str]

    def count(self, status: str) -> int:
        return sum(r["status"] == status for r in self.results.values())


def _existing(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return load_result(path)
    except UserInputError:
        return None  # a damaged result: the cell runs again and replaces it


def check_results_dir(
    matrix: MatrixConfig, cells: Sequence[Cell], out_dir: Path
) -> dict[str, dict[str, Any]]:
    """The results in `out_dir` that cells of `matrix` can reuse (cell id → result); a UserInputError line when
    `out_dir` holds another matrix's (see the module docstring). Writes nothing."""
    refuse = (
        f"{out_dir} holds the results of another matrix ({{}}); allowed: the same matrix, or another --out"
    )
    stored_path = out_dir / "matrix.yaml"
    if stored_path.exists():
        stored, current = load_yaml(stored_path, what="the matrix of the results directory"), to_dict(matrix)
        for key in dict.fromkeys([*current, *stored]):
            if stored.get(key) != current.get(key):
                there, here = brief(stored.get(key)), brief(current.get(key))
                raise UserInputError(refuse.format(f"matrix.yaml: {key} {there} there, {here} here"))
    found = {}
    for cell in cells:
        result = _existing(cell_result_path(out_dir, cell.id))
        if result is None:
            continue
        differs = _differs(cell, matrix, result)
        if differs:
            raise UserInputError(refuse.format(f"cells/{cell.id}/result.json: {differs}"))
        found[cell.id] = result
    return found


def _differs(cell: Cell, matrix: MatrixConfig, result: dict[str, Any]) -> str | None:
    """How `result` is not one the cell made (`_SAME_CELL`, warm-up and measured steps), or None."""
    expected = _cell(cell)
    recorded = {f"cell.{k}": (result["cell"][k], expected[k]) for k in _SAME_CELL}
    recorded["steps.warmup"] = (result["steps"]["warmup"], cell_warmup_steps(cell.config))
    if result["status"] == "ok":  # a cell that ended early measured fewer steps
        recorded["steps.measured"] = (result["steps"]["measured"], matrix.measure_steps)
    for key, (there, here) in recorded.items():
        if there != here:
            return f"{key} {brief(there)} there, {brief(here)} here"
    return None


def _run_cell(cell: Cell, cell_dir: Path, timeout_s: float, environment: dict[str, Any]) -> dict[str, Any]:
    run_dir = cell_dir / "run"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an attempt that left no result; its outputs are not a result of anything
    cell_dir.mkdir(parents=True, exist_ok=True)
    save_yaml(cell.config, cell_dir / "cell.yaml")
    command = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--config", str(cell_dir / "cell.yaml"),
               "--out", str(run_dir), "--resume", "never", "--no-progress", "--sample-tokens", "0"]  # fmt: skip
    job = run_job(command, cell_dir / "train.log", timeout_s=timeout_s)
    warmup = cell_warmup_steps(cell.config)
    with job.log_path.open(errors="replace") as log:
        printed = collect_from_lines(log, str(job.log_path))
    if printed and job.status != "timeout":
        # Measured and printed whole (hash-checked): a rank that died afterwards, while exiting, does not undo the
        # measurement; the exit is kept in the reason.
        result = printed[-1]
        if job.status != "ok":
            result["reason"] = f"the result was printed, then the job ended: {job.reason}"
        return result
    if job.status == "ok":
        reason = f"exit 0 but no result was printed (see {job.log_path})"
        return failed_result(_cell(cell), "failed", reason, warmup_steps=warmup, environment=environment)
    status = _STATUS[job.status]
    return failed_result(_cell(cell), status, job.reason, warmup_steps=warmup, environment=environment)


def _cell(cell: Cell) -> dict[str, Any]:
    # A cell that never ran never resolved "auto" (to 32-true on CPU, bf16-mixed elsewhere); it is kept as asked.
    return cell_of_config(cell.config, precision=cell.config.train.precision)


def _fill_scaling(cells: Sequence[Cell], results: dict[str, dict[str, Any]]) -> None:
    """tokens/s ÷ (ranks × tokens/s of the 1-rank cell with the same model, strategy, micro-batch, precision)."""
    baseline = {
        (c.model, c.strategy, c.micro_batch_size, c.precision): results[c.id]
        for c in cells
        if c.world_size == 1 and results.get(c.id, {}).get("status") == "ok"
    }
    for c in cells:
        result = results.get(c.id)
        if result is None or result["status"] != "ok" or c.world_size == 1:
            continue
        one = baseline.get((c.model, c.strategy, c.micro_batch_size, c.precision))
        efficiency = None
        if one is not None:
            efficiency = result["metrics"]["tokens_per_s"] / (c.world_size * one["metrics"]["tokens_per_s"])
        result["metrics"]["scaling_efficiency"] = efficiency


def run_matrix(
    matrix: MatrixConfig,
    cells: Sequence[Cell],
    out_dir: Path,
    *,
    timeout_s: float | None = None,
    retry_failed: bool = False,
    console: Console | None = None,
    on_cell: Callable[[dict[str, Any], Path], str | None] | None = None,
) -> MatrixOutcome:
    """Run the cells without a result (all of them with `retry_failed`, failed ones too); `on_cell(result,
    run_dir)` sees each cell run now with its run directory, and the line it returns is printed under the cell's
    (`gaudi3 benchmark run` feeds the calibration store with it: forecast.feed)."""
    from gaudi3_scale.monitor.environment import environment_info

    console = console or Console(stderr=True)
    done = check_results_dir(matrix, cells, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not (out_dir / "matrix.yaml").exists():  # else it is this matrix already (check_results_dir)
        save_yaml(matrix, out_dir / "matrix.yaml")
    environment = environment_info()
    results: dict[str, dict[str, Any]] = {}
    ran: list[str] = []
    skipped: list[str] = []
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} cells"),
               TimeElapsedColumn(), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"matrix {matrix.name}", total=len(cells))
        for cell in cells:
            path = cell_result_path(out_dir, cell.id)
            existing = done.get(cell.id)
            if existing is not None and (existing["status"] == "ok" or not retry_failed):
                results[cell.id] = existing
                skipped.append(cell.id)
                progress.advance(task)
                continue
            progress.update(task, description=f"cell {cell.label}")
            result = _run_cell(cell, path.parent, timeout_s or matrix.timeout_s, environment)
            write_result(result, path)
            results[cell.id] = result
            ran.append(cell.id)
            shown = (
                f"{result['metrics']['tokens_per_s']:,.0f} tok/s"
                if result["status"] == "ok"
                else result["status"]
            )
            note = "" if result["status"] == "ok" else f" — {result['reason']}"
            progress.console.print(f"  {cell.label}: {shown}{note}", highlight=False)
            fed = on_cell(result, path.parent / "run") if on_cell is not None else None
            if fed:
                progress.console.print(f"    {fed}", highlight=False)
            progress.advance(task)
    _fill_scaling(cells, results)
    for cell in cells:
        write_result(results[cell.id], cell_result_path(out_dir, cell.id))
    return MatrixOutcome(results=results, ran=ran, skipped=skipped)
