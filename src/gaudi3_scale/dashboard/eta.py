"""The run page's progress view: the run's forecast (plan.json, `gaudi3 train` records it at its start) as a
predicted line of steps over wall time, beside the measured progress, and the finish each of them points to.

Time runs from the trainer's start, the clock of summary.json's `wall_s` and of the forecast's wall time
(docs/foresight.md): a train record of metrics.jsonl carries `wall_s` and `time_unix` at its window's end
(`train.step_metrics`), so the run's start is `time_unix - wall_s`.

- **Predicted line**: step 0 (a resumed run: its checkpoint's step, the forecast's `run.start_step`) until the
  forecast's startup ends, the warm-up steps, then the steady steps to `train.max_steps` at `predicted_wall_s`;
  validation and checkpoint pauses are spread over the steps in proportion to their time (they recur every so
  many steps). The predicted finish is the run's start + `predicted_wall_s`;
  its source is "probe" when a probe measured this layout (`run.probed`), else "catalog".
- **Live ETA**: the newest record's `wall_s` + the steps left × the wall time per step over the last records of
  the process (pauses included, as the cost meter's projection does), or the record's own `step_time_s` while
  there is one record; a finished run's is its summary's `wall_s`. Records of an earlier process of the run
  (a resume) or before a rollback are left out.
- A run without plan.json has no predicted line ("no forecast for this run"); an unreadable plan.json is one note.
"""

from __future__ import annotations

import time
from typing import Any

from gaudi3_scale.config.numbers import finite_number
from gaudi3_scale.dashboard.formatting import MISSING, hours, local_time
from gaudi3_scale.dashboard.runs import MetricsView

__all__ = ["NO_FORECAST", "run_eta"]

NO_FORECAST = "no forecast for this run"
PACE_RECORDS = 6  # the live pace is over the windows between the last this-many train records
# Lines looked at from the end of metrics.jsonl for those records (validation and event lines lie between them).
_SCAN_LINES = 400


def _part(plan: dict[str, Any], name: str) -> float | None:
    """One of the forecast's wall-time parts (`wall.startup_s.value` …), None when absent or unknown."""
    wall = plan.get("wall")
    figure = wall.get(name) if isinstance(wall, dict) else None
    value = finite_number(figure.get("value")) if isinstance(figure, dict) else None
    return None if value is None or value < 0 else value


def _start_step(plan: dict[str, Any], max_steps: int) -> int:
    """The step a resumed run's forecast starts from (`run.start_step`); 0 for a fresh run or an older plan."""
    run = plan.get("run")
    start = run.get("start_step") if isinstance(run, dict) else None
    if isinstance(start, int) and not isinstance(start, bool) and 0 <= start < max_steps:
        return start
    return 0


def _predicted_points(plan: dict[str, Any], wall_s: float, max_steps: int) -> list[list[float]]:
    """[seconds since the trainer's start, step] of the forecast, from (0, start step) to (wall_s, max_steps)."""
    start = float(_start_step(plan, max_steps))
    points = [[0.0, start]]
    startup = _part(plan, "startup_s")
    if startup is None or startup >= wall_s:
        startup = 0.0
    elif startup > 0:
        points.append([startup, start])
    run = plan.get("run")
    warmup_steps = finite_number(run.get("warmup_steps")) if isinstance(run, dict) else None
    warmup, steady = _part(plan, "warmup_s"), _part(plan, "steady_s")
    if (
        warmup_steps
        and 0 < start + warmup_steps < max_steps
        and warmup is not None
        and steady
        and warmup + steady > 0
    ):
        training_s = wall_s - startup  # the steps' own time and the pauses among them
        points.append([startup + training_s * warmup / (warmup + steady), start + warmup_steps])
    points.append([wall_s, float(max_steps)])
    return points


def _forecast(
    plan: Any, problem: str | None, max_steps: int | None
) -> tuple[dict[str, Any] | None, str | None]:
    """(what the page draws of plan.json, None) or (None, the one note why not; None: there is no plan.json)."""
    if problem is not None:
        return None, problem
    if plan is None:
        return None, None
    wall_s = finite_number(plan.get("predicted_wall_s"))
    if wall_s is None or wall_s <= 0:
        return None, "plan.json has no predicted_wall_s (a positive number of seconds)"
    run = plan.get("run") if isinstance(plan.get("run"), dict) else {}
    steps = run.get("max_steps")
    steps = steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else max_steps
    if steps is None:
        return None, "plan.json names no max_steps, nor does config.yaml"
    step_source = plan.get("predicted_step_time_source")
    return {
        "wall_s": wall_s,
        "step_time_s": finite_number(plan.get("predicted_step_time_s")),
        "max_steps": steps,
        "source": "probe" if run.get("probed") is True else "catalog",
        "step_time_source": step_source if isinstance(step_source, str) else None,
        "points": _predicted_points(plan, wall_s, steps),
    }, None


def _progress(view: MetricsView) -> list[tuple[float, int, dict[str, Any]]]:
    """(wall_s, step, record) of the newest train records of the run's latest process, oldest first: back from the
    end until a record that is not before the next one in both time and step (another process, a rollback)."""
    found: list[tuple[float, int, dict[str, Any]]] = []
    for record in reversed(view.recent[-_SCAN_LINES:]):
        wall_s = finite_number(record.get("wall_s")) if record is not None else None
        step = record.get("step") if record is not None else None
        if wall_s is None or not isinstance(step, int) or "time_unix" not in record:
            continue  # validation and event records; records of a run from before wall_s was written
        if found and not (wall_s < found[-1][0] and step < found[-1][1]):
            break
        found.append((wall_s, step, record))
        if len(found) == PACE_RECORDS:
            break
    return found[::-1]


def _live(
    progress: list[tuple[float, int, dict[str, Any]]], summary: dict[str, Any] | None, max_steps: int | None
) -> dict[str, Any] | None:
    """The run's whole wall time as measured so far: done (`finished`) or projected from the recent pace."""
    if summary is not None and (wall_s := finite_number(summary.get("wall_s"))) is not None:
        return {"wall_s": wall_s, "finished": True}
    if not progress or max_steps is None:
        return None
    (w0, s0, _), (w1, s1, newest) = progress[0], progress[-1]
    pace = (w1 - w0) / (s1 - s0) if s1 > s0 else finite_number(newest.get("step_time_s"))
    if pace is None:
        return None
    return {"wall_s": w1 + max(0, max_steps - s1) * pace, "finished": False, "step": s1}


def _clock(unix_s: float | None, now_unix: float) -> str:
    """HH:MM local time; with the date when it is not today."""
    moment, today = local_time(unix_s), local_time(now_unix)
    if moment is None or today is None:
        return MISSING
    same_day = moment[:3] == today[:3]
    return time.strftime("%H:%M" if same_day else "%Y-%m-%d %H:%M", moment)


def _texts(
    forecast: dict[str, Any] | None,
    note: str | None,
    predicted_finish_unix: float | None,
    live: dict[str, Any] | None,
    now_unix: float,
) -> dict[str, str | None]:
    """The page's two lines: the forecast's finish (or why there is none) and the live ETA (None: none yet)."""
    if forecast is None:
        predicted = NO_FORECAST if note is None else f"{NO_FORECAST} ({note})"
    else:
        predicted = (
            f"predicted finish {_clock(predicted_finish_unix, now_unix)} "
            f"(forecast: {hours(forecast['wall_s'] / 3600)}; source: {forecast['source']})"
        )
    if live is None:
        return {"predicted": predicted, "live": None}
    what = "finished" if live["finished"] else "live ETA"
    shown = f"{what} {_clock(live['finish_unix'], now_unix)} ({hours(live['wall_s'] / 3600)} in all"
    if live["difference"] is not None:
        shown += f", {live['difference']:+.1%} vs the forecast"
    return {"predicted": predicted, "live": shown + ")"}


def _started_unix(progress: list[tuple[float, int, dict[str, Any]]]) -> float | None:
    """When the trainer of the latest process started (Unix time), from its newest record."""
    if not progress:
        return None
    wall_s, _, newest = progress[-1]
    time_unix = finite_number(newest.get("time_unix"))
    return None if time_unix is None else time_unix - wall_s


def run_eta(
    plan: Any,
    plan_problem: str | None,
    view: MetricsView,
    summary: dict[str, Any] | None,
    *,
    max_steps: int | None,
    status: str,
    now_unix: float | None = None,
) -> dict[str, Any]:
    """The progress view of one run (module docstring): `forecast` (None without one, `note` says why when it is
    not simply absent), the run's `started_unix`, `predicted_finish_unix`, `live` (None before the first record
    and once a run stopped without finishing) and the page's `text` lines. `status` is `RunStore.status`'s."""
    now_unix = time.time() if now_unix is None else now_unix
    forecast, note = _forecast(plan, plan_problem, max_steps)
    progress = _progress(view)
    started = _started_unix(progress)
    predicted_finish = None if forecast is None or started is None else started + forecast["wall_s"]
    live = None
    if status != "stopped":
        steps = max_steps or (forecast["max_steps"] if forecast else None)
        live = _live(progress, summary if status == "finished" else None, steps)
    if live is not None:
        live["finish_unix"] = None if started is None else started + live["wall_s"]
        live["difference"] = None if forecast is None else live["wall_s"] / forecast["wall_s"] - 1
    return {
        "forecast": forecast,
        "note": note,
        "started_unix": started,
        "predicted_finish_unix": predicted_finish,
        "live": live,
        "text": _texts(forecast, note, predicted_finish, live, now_unix),
    }
