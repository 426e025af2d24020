"""Benchmark result sets under the runs directory: their `gaudi3 benchmark report` HTML and their cells."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.dashboard.files import first_escape, has_file
from gaudi3_scale.dashboard.formatting import MISSING, gib, percent, rate

__all__ = ["benchmark_cells", "report_html"]

# A damaged result file's row shows nothing of these: they are inside what could not be read.
_CELL_COLUMNS = ("model", "strategy", "world_size", "precision", "micro_batch_size", "tokens_per_s", "mfu",
                 "peak_memory", "scaling_efficiency")  # fmt: skip


def report_html(root: Path, directory: Path) -> Path | None:
    """The self-contained report.html of `gaudi3 benchmark report DIR --out DIR/report` (or --out DIR), inside the
    runs directory `root`."""
    for path in (directory / "report" / "report.html", directory / "report.html"):
        if has_file(root, path):
            return path
    return None


def benchmark_cells(root: Path, directory: Path) -> tuple[list[dict[str, Any]], str | None]:
    """One row per cell result (`bench.report.scan_results`) and one, with status "damaged", per result file that
    is not a valid result (a cut-short copy: the report refuses the set); or a one-line reason there are none (one
    is a link out of the runs directory `root`: the scan reads the whole tree, so none of it is read then)."""
    from gaudi3_scale.bench.report import scan_results

    escape = first_escape(root, directory)
    if escape is not None:
        return [], str(escape)
    try:
        scan = scan_results(directory)
    except UserInputError as exc:
        return [], str(exc)
    rows = []
    for item in scan.items:
        result = item.result
        cell, metrics = result["cell"], result.get("metrics") or {}
        rows.append({
            "id": cell["id"],
            "model": cell["model"],
            "strategy": cell["strategy"],
            "world_size": cell["world_size"],
            "precision": cell["precision"],
            "micro_batch_size": cell["micro_batch_size"],
            "status": result["status"],
            "reason": result["reason"],
            "tokens_per_s": rate(metrics.get("tokens_per_s")),
            "mfu": percent(metrics.get("mfu")),
            "peak_memory": gib(metrics.get("peak_memory_bytes")),
            "scaling_efficiency": MISSING if metrics.get("scaling_efficiency") is None
            else f"{metrics['scaling_efficiency']:.2f}",
        })  # fmt: skip
    rows.sort(key=lambda r: (r["model"], r["strategy"], r["world_size"], r["id"]))
    return rows + [_damaged_row(directory, path, problem) for path, problem in scan.damaged], None


def _damaged_row(directory: Path, path: Path, problem: str) -> dict[str, Any]:
    """A result file that could not be read, named by its path under the set (cells/<id>/result.json)."""
    row: dict[str, Any] = dict.fromkeys(_CELL_COLUMNS, MISSING)
    return {**row, "id": str(path.relative_to(directory)), "status": "damaged", "reason": problem}
