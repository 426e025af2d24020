"""How a health event of metrics.jsonl is marked on a loss curve. loss.png (`train.report.plot_loss`), the
dashboard's live loss chart (its metrics API serves `health_marks`, static/charts.js draws them) and the rollback
plot of docs/health.md (benchmarks/bench_health_rollback_plot.py) all classify records here, so they agree.

Three marks. A record's `step` is the update count before the event, while a train record's `step` is the count
after its update, so a mark is drawn `at` the place on the loss curve's axis where its event happened:

    dropped   the guard dropped the update: a non-finite step, or a spike under `health.spike_policy skip`; at
              step + 0.5, between the last applied update's point and the next one's (which read the next batch)
    spike     a loss or gradient-norm spike whose update was applied (`warn`): at step + 1, the point of the loss
              that spiked; one that stopped the run (`stop`, its update dropped) at step + 0.5
    rollback  the run went back from step `from_step` to the checkpoint of step `to_step`: at the step it went back
              from; the spike that asked for it has no mark of its own

No torch here: the dashboard imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["MARKS", "event_mark", "health_marks", "mark_position"]

# mark: (legend label, what it means: the legend's and the marker's hover text)
MARKS: dict[str, tuple[str, str]] = {
    "dropped": ("update dropped", "a step whose update the health guard dropped (non-finite, or a skipped spike)"),
    "spike": ("spike", "a loss or gradient-norm spike: warned of (the update applied), or it stopped the run"),
    "rollback": ("rollback", "the run went back to an earlier checkpoint (shaded: the steps it went back over) "
                 "and skipped batches"),
}  # fmt: skip


def event_mark(record: dict[str, Any]) -> str | None:
    """The mark of a metrics.jsonl record (a key of MARKS), or None: not a health event, or a spike that rolled
    back (its rollback record is marked)."""
    event, action = record.get("health_event"), record.get("health_action")
    if event is None:
        return None
    if event == "rollback":
        return "rollback"
    if action == "skip":
        return "dropped"
    return "spike" if action in ("warn", "stop") else None


def mark_position(record: dict[str, Any]) -> float:
    """Where a marked record is drawn on the optimizer-step axis of a loss curve (the module docstring)."""
    step = float(record["step"])
    if record.get("health_event") == "rollback":
        return step
    return step + 1 if record.get("health_action") == "warn" else step + 0.5


def health_marks(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The marks of these records as the dashboard draws them: `step` (the record's), `at` (`mark_position`),
    `mark`, `event` (health_event), `label`, `help`, `detail`, and for a rollback `from_step` and `to_step`."""
    marks = []
    for record in records:
        mark = event_mark(record)
        step = record.get("step")
        if mark is None or not isinstance(step, int):
            continue
        label, meaning = MARKS[mark]
        entry = {"step": step, "at": mark_position(record), "mark": mark, "event": record["health_event"],
                 "label": label, "help": meaning, "detail": str(record.get("detail", ""))}  # fmt: skip
        if mark == "rollback":
            entry.update(from_step=record.get("from_step", step), to_step=record.get("to_step"))
        marks.append(entry)
    return marks
