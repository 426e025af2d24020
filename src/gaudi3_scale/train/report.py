"""What a finished run leaves for people: summary.json, loss.png and a table in the terminal."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gaudi3_scale.config import strict_json
from gaudi3_scale.config.atomic import write_text_atomic
from gaudi3_scale.health.marks import MARKS, event_mark, mark_position

__all__ = [
    "draw_health_marks",
    "plot_loss",
    "print_summary",
    "read_metrics",
    "write_run_report",
    "write_summary",
]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl, non-finite values as floats again (`config.strict_json`)."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [strict_json.restore_non_finite(json.loads(line)) for line in lines if line.strip()]


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    write_text_atomic(path, strict_json.dumps(summary, indent=2) + "\n")


# What a fit that resumed a finished run says of itself over the run's kept summary: it trained nothing and was
# not stopped (its exit code comes from these), whatever the run's last fit was.
_THIS_FIT = ("interrupted", "stop_signal", "stop_reason", "stop_exit_code", "signal_to_checkpoint_s")


def read_kept_summary(out_dir: Path, fresh: dict[str, Any], *, max_steps: int) -> dict[str, Any] | None:
    """The summary.json of a run whose checkpoint was at train.max_steps already, with this fit's stop fields from
    `fresh` (it trained nothing: its own throughput and wall time are of no step); None when there is none to
    read (a run directory without one, one cut short, or an earlier fit's: killed after its last checkpoint and
    before its summary, the run's summary is of fewer than `max_steps` steps), and the fit's own summary is
    written instead."""
    path = out_dir / "summary.json"
    try:
        kept = strict_json.restore_non_finite(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("steps") != max_steps:
        return None
    return {**kept, **{key: fresh.get(key) for key in _THIS_FIT}}


def write_run_report(
    out_dir: Path,
    summary: dict[str, Any],
    records: list[dict[str, Any]],
    *,
    title: str,
    console: Console | None,
) -> None:
    """What a fit leaves in its run directory (rank 0): summary.json and loss.png; and the table on `console`
    (None: not printed)."""
    write_summary(out_dir / "summary.json", summary)
    plot_loss(records, out_dir / "loss.png", title=title)
    if console is not None:
        print_summary(summary, console)


# How a loss plot draws the marks of `health.marks` (docs/health.md): a vertical line where the event happened.
_MARK_STYLES = {  # mark: (colour, line style)
    "dropped": ("tab:red", ":"),
    "spike": ("tab:orange", "--"),
    "rollback": ("tab:purple", "-"),
}


def draw_health_marks(ax: Any, records: list[dict[str, Any]]) -> bool:
    """Mark the health events of these metrics.jsonl records on a matplotlib axis whose x is the optimizer step: a
    line per event, labelled once per kind, and for a rollback the steps it went back over shaded. Whether any
    was drawn."""
    marked = False
    for mark, (color, linestyle) in _MARK_STYLES.items():
        events = [r for r in records if event_mark(r) == mark]
        for i, at in enumerate(sorted({mark_position(r) for r in events})):
            label = MARKS[mark][0] if i == 0 else None
            ax.axvline(at, color=color, linestyle=linestyle, linewidth=1.0, alpha=0.8, label=label)
            marked = True
        for r in events:
            if mark == "rollback" and r.get("to_step") is not None:
                ax.axvspan(r["to_step"], r["step"], color=color, alpha=0.12)
    return marked


def plot_loss(records: list[dict[str, Any]], path: Path, *, title: str) -> None:
    """Train and validation loss against optimizer step, with the run's health events marked. After a rollback
    the steps it replayed are the ones the run kept (a step's newest record)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = sorted({r["step"]: r["train_loss"] for r in records if r.get("train_loss") is not None}.items())
    val = sorted({r["step"]: r["val_loss"] for r in records if r.get("val_loss") is not None}.items())
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train, strict=True), label="train", linewidth=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation", linewidth=1.5)
    marked = draw_health_marks(ax, records)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if train or val or marked:
        ax.legend()
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return strict_json.non_finite_name(value)  # as summary.json spells it
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    return str(value)


_RATIOS = {"mfu", "val_mlm_accuracy"}  # shown as percentages
# Forecast for steps after the warm-up: a measured mean over warm-up steps is not compared with them (here and in
# `gaudi3 plan --compare`).
STEADY_KEYS = ("step_time_s", "tokens_per_s")
# Measured over the whole run: a run that stopped before its last step measured fewer steps than were forecast.
WHOLE_RUN_KEYS = ("wall_s", "cost_usd")


def stopped_early(summary: dict[str, Any]) -> str | None:
    """Why a run stopped before its last step (a signal, a budget, the step guard), as a note; None when it ran to
    its end. Its wall time and cost are then of fewer steps than its forecast's: not compared with it."""
    if not summary.get("interrupted") and summary.get("stop_exit_code") is None:
        return None
    why = summary.get("stop_reason") or summary.get("stop_signal") or "interrupted"
    return (f"the run stopped after step {summary.get('steps')} ({why}): its wall time and cost are of fewer steps "
            "than the forecast's, so no error is given")  # fmt: skip


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    table = Table(title=f"run {summary.get('name', '')}", show_header=False)
    labels = {
        "steps": "optimizer steps",
        "train_loss": "train loss",
        "val_loss": "val loss",
        "val_mlm_accuracy": "val masked-token accuracy",  # arch bert only (trainer summary)
        "tokens_per_s": "tokens/s",
        "mfu": "MFU",
        "step_time_s": "step time (s)",
        "peak_memory_bytes": "peak memory (bytes)",
        "wall_s": "wall time (s)",
        "checkpoint": "checkpoint",
    }
    for key, label in labels.items():
        if key in summary:
            value = summary[key]
            ratio = key in _RATIOS and isinstance(value, float) and math.isfinite(value)
            text = f"{value:.2%}" if ratio else _fmt(value)
            table.add_row(label, text + _predicted(summary, key))
        if key == "step_time_s" and summary.get("measured_steps"):
            table.add_row("measured over", _measured_over(summary))
    (console or Console()).print(table)


def _predicted(summary: dict[str, Any], key: str) -> str:
    """`gaudi3 plan`'s prediction of a measured value, and its error, when the run has one."""
    predicted, measured = summary.get(f"predicted_{key}"), summary.get(key)
    if not isinstance(predicted, int | float) or not isinstance(measured, int | float) or not measured:
        return ""
    if key in STEADY_KEYS and summary.get("throughput_includes_warmup"):
        # the prediction is of steady steps; a mean over warm-up steps says nothing about its error
        return f" (predicted {_fmt(predicted)} for steady steps; not compared with warm-up steps)"
    if key in WHOLE_RUN_KEYS and stopped_early(summary):
        return f" (predicted {_fmt(predicted)} for the whole run; it stopped early)"
    return f" (predicted {_fmt(predicted)}, {predicted / measured - 1:+.0%})"


def _measured_over(summary: dict[str, Any]) -> str:
    """Which steps tokens/s, MFU and step time are over, what the warm-up took, and the profiled steps left out."""
    steps, warmup = summary["measured_steps"], summary.get("warmup_steps") or 0
    profiled = summary.get("profiled_steps") or 0
    left_out = f"; {profiled} profiled steps left out" if profiled else ""
    if summary.get("throughput_includes_warmup"):
        return f"{steps} steps, warm-up included (no measured step after it in this process){left_out}"
    if not warmup:
        return f"{steps} steps{left_out}"
    return f"{steps} steps after {warmup} warm-up steps ({_fmt(summary.get('warmup_s'))} s){left_out}"
