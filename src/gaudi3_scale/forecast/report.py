"""A forecast for people (`format_forecast`) and held against a finished run (`compare_with_run`: the error of
each predicted quantity against the run's summary.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gaudi3_scale.config import strict_json
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.config.numbers import finite_number
from gaudi3_scale.forecast.figures import Figure
from gaudi3_scale.forecast.model import Forecast, fit_words

__all__ = ["COMPARED", "compare_with_run", "format_comparison", "format_forecast", "read_run_summary"]

# predicted field of summary.json / a forecast → the measured field of summary.json, and its unit. The measured
# cost_usd is the live meter's (train/cost_callback.py: fit start to the last step, what cost.budget_usd is held
# against), so it is held against the forecast of that window, not predicted_cost_usd (the whole wall's bill).
COMPARED = {
    "predicted_step_time_s": ("step_time_s", "s"),
    "predicted_wall_s": ("wall_s", "s"),
    "predicted_peak_memory_bytes": ("peak_memory_bytes", "B"),
    "predicted_tokens_per_s": ("tokens_per_s", "tokens/s"),
    "predicted_metered_cost_usd": ("cost_usd", "$"),
}
WARMUP_NOTE = ("measured over warm-up steps (summary.json throughput_includes_warmup: no step after the warm-up in "
               "this process); the prediction is of steady steps, so no error is given")  # fmt: skip
METERED_NOTE = ("cost_usd: both sides are the live meter's window, fit start to the last step (what cost.budget_usd "
                "is held against); the bill for the whole wall time is plan.json's cost_usd")  # fmt: skip


def _value(figure: Figure, unit: str) -> str:
    if figure.value is None:
        return "unknown"
    v = figure.value
    if unit == "B":
        return f"{v / 2**30:.3f} GiB"
    if unit == "s":
        return f"{v:.4g} s" if v < 600 else f"{v / 3600:.3g} h"
    if unit == "$":
        return f"${v:,.2f}"
    return f"{v:,.4g} {unit}"


def format_forecast(forecast: Forecast) -> list[str]:
    run = forecast.run
    steps = (
        f"steps {run['start_step']}–{run['max_steps']}" if run["start_step"] else f"{run['max_steps']} steps"
    )
    lines = [
        f"forecast of {run['name']} ({run['model']}, {steps}) on {run['nodes']} node(s) of "
        f"{run['machine']} ({run['device']}), {run['world_size']} rank(s), {run['layout']['strategy']}"
        + (" — from a probe of this layout" if run["probed"] else ""),
        "per-rank peak memory:",
    ]
    for name, figure in forecast.memory.items():
        lines.append(f"  {name.removesuffix('_bytes'):<12} {_value(figure, 'B'):>14}  {figure.source}")
    fit = {True: "fits", False: "DOES NOT FIT", None: "fit unknown"}[forecast.fits]
    lines.append(f"  {fit}: {fit_words(forecast)} ({forecast.device_memory_bytes.source})")
    # kept, not dropped: they still rank layouts (benchmarks/plan_scale_out.py), but said to be of a run that cannot
    # start, here and in the notes
    if forecast.fits is False:
        lines.append(
            "  the step, wall time, energy and cost below are of a run that cannot start (out of memory)"
        )
    lines.append("step:")
    for name, figure in forecast.step.items():
        lines.append(f"  {name.removesuffix('_s'):<12} {_value(figure, 's'):>14}  {figure.source}")
    lines.append(
        f"  {'tokens/s':<12} {_value(forecast.tokens_per_s, ''):>14}  {forecast.tokens_per_s.source}"
    )
    lines.append("wall time (as summary.json's wall_s: from the trainer's start):")
    for name, figure in forecast.wall.items():
        lines.append(f"  {name.removesuffix('_s'):<12} {_value(figure, 's'):>14}  {figure.source}")
    lines.append(f"energy       {_value(forecast.energy_kwh, 'kWh'):>14}  {forecast.energy_kwh.source}")
    lines.append(f"cost         {_value(forecast.cost_usd, '$'):>14}  {forecast.cost_usd.source}")
    metered = forecast.metered_cost_usd
    lines.append(f"  metered    {_value(metered, '$'):>14}  {metered.source}")
    sample = forecast.sample_memory_bytes
    lines.append(f"sample       {_value(sample, 'B'):>14}  {sample.source}")
    return lines + forecast.notes


def read_run_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    if not path.is_file():
        raise UserInputError(f"--compare: {run_dir} has no summary.json; expected the output directory of a "
                             "finished gaudi3 train run")  # fmt: skip
    try:
        summary = json.loads(path.read_text())
    except ValueError:
        raise UserInputError(
            f"--compare: {path} is not JSON (a run that was killed while writing it?)"
        ) from None
    if not isinstance(summary, dict):
        raise UserInputError(f"--compare: {path} is not a run summary")
    return strict_json.restore_non_finite(summary)  # "Infinity" and "NaN" as summary.json spells them


def compare_with_run(predicted: dict[str, Any], summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Per quantity: predicted, measured and the error (predicted ÷ measured − 1), where both are known and
    measure the same thing; `note` says why a row has no error or what it covers."""
    from gaudi3_scale.train.report import STEADY_KEYS, WHOLE_RUN_KEYS, stopped_early

    warmup = summary.get("throughput_includes_warmup") is True
    stopped = stopped_early(summary)
    rows = []
    for key, (measured_key, unit) in COMPARED.items():
        p, m = finite_number(predicted.get(key)), finite_number(summary.get(measured_key))  # else "—"
        error = (p / m - 1) if p is not None and m else None
        note = METERED_NOTE if measured_key == "cost_usd" else None
        if warmup and measured_key in STEADY_KEYS:
            error, note = None, WARMUP_NOTE
        if stopped and measured_key in WHOLE_RUN_KEYS:
            error, note = None, stopped
        rows.append({"quantity": measured_key, "unit": unit, "predicted": p, "measured": m, "error": error,
                     "note": note})  # fmt: skip
    return rows


def format_comparison(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'quantity':<20} {'predicted':>16} {'measured':>16} {'error':>9}"]
    notes: list[str] = []
    for row in rows:
        unit = row["unit"]
        shown = [
            _value(Figure(row[k], ""), unit) if row[k] is not None else "—" for k in ("predicted", "measured")
        ]
        error = f"{row['error']:+.1%}" if row["error"] is not None else "—"
        note, mark = row.get("note"), ""
        if note:
            if note not in notes:
                notes.append(note)
            mark = "*" * (notes.index(note) + 1)
        lines.append(f"{row['quantity'] + mark:<20} {shown[0]:>16} {shown[1]:>16} {error:>9}")
    return lines + ["*" * (i + 1) + " " + note for i, note in enumerate(notes)]
