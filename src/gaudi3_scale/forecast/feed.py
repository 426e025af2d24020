"""Measured runs feed this machine's calibration store: each `gaudi3 tune` trial and `gaudi3 benchmark run` cell is a
short real `gaudi3 train` run with a summary.json, so once it has ended well it is a probe of its layout, as
`gaudi3 plan --probe`'s run is (`probe.probe_from_summary`). A later `gaudi3 plan` of that layout on this machine
forecasts from it and names it as its source ("probe of this layout, from tune trial …").

The CLI hands each trial and cell it has just run to `feed_run` (`tune` and `bench` sit beside `forecast`, which
imports `tune`; they do not import it); from Python, `AdaptiveBatchFinder(..., on_trial=feed_tune_trial)` feeds
the store as `gaudi3 tune` does. A run is stored only when it ended ok, ran on this machine — its plan.json,
the forecast `gaudi3 train` records at its start, names this machine's calibration store — and its layout key is
the one `RunShape.key` computes for its config here. Anything else is one note saying why not: feeding the store
never stops a tune or a benchmark."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from gaudi3_scale.forecast.calibration import Probe
from gaudi3_scale.tune.trial import TrialResult

__all__ = ["feed_run", "feed_tune_trial"]

NOTE = "calibration store"


def feed_run(run_dir: Path, *, status: str, origin: str) -> str:
    """Store the probe of the finished run in `run_dir` (`status`: its trial's or cell's; only "ok" is stored) under
    `origin` ("tune trial DIR", "benchmark cell DIR"); the one line to print: what was stored, or why not."""
    if status != "ok":
        return f"{NOTE}: not fed ({status}: a run that failed or ran out of memory measures no step)"
    try:
        probe, why = _store_probe(run_dir, origin)
    except Exception as exc:  # an unreadable run is a note: a tune or a benchmark goes on without its probe
        return f"{NOTE}: not fed ({type(exc).__name__}: {exc})"
    if probe is None:
        return f"{NOTE}: not fed ({why})"
    return (
        f"{NOTE}: probe of this layout stored ({probe.step_time_s:.4g} s a step); gaudi3 plan of it uses it"
    )


def feed_tune_trial(result: TrialResult, run_dir: Path) -> str:
    """The tuner's `on_trial` hook (`run_tuner`, `AdaptiveBatchFinder`): the trial run just now in `run_dir` is a
    probe of its layout; the line to print under the trial's."""
    return feed_run(run_dir, status=result.status, origin=f"tune trial {run_dir.parent}")


def _read(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else None


def _store_probe(run_dir: Path, origin: str) -> tuple[Probe | None, str]:
    from gaudi3_scale.forecast.probe import probe_from_summary
    from gaudi3_scale.forecast.run import machine_for, run_shape
    from gaudi3_scale.train.config import resolve_config
    from gaudi3_scale.train.forecast_file import PLAN_FILE
    from gaudi3_scale.tune.estimate_table import resolved_model

    summary, plan = _read(run_dir / "summary.json"), _read(run_dir / PLAN_FILE)
    if summary is None:
        return None, f"{run_dir} has no summary.json"
    if (
        not summary.get("step_time_s")
        or not summary.get("measured_steps")
        or not summary.get("peak_memory_bytes")
    ):
        return None, "its summary has no measured steps or peak memory"
    if summary.get("interrupted"):
        return None, "the run was interrupted"
    if plan is None:
        return (
            None,
            f"{run_dir} has no {PLAN_FILE} (its forecast failed at its start): the machine it ran on is unknown",
        )
    cfg = resolve_config(str(run_dir / "config.yaml"), ())
    machine = machine_for(cfg, None)
    if machine.store is None:
        return None, f"this machine ({machine.device_name}) keeps no calibration store"
    ran_on = plan.get("run", {}).get("calibration_machine")
    if ran_on != machine.store.machine:
        return (
            None,
            f"it ran on {ran_on or 'a machine without a store'}, not on this one ({machine.store.machine})",
        )
    shape = run_shape(cfg, resolved_model(cfg.model, cfg.data), machine)
    recorded = plan["run"].get("probe_key")
    if recorded != shape.key:
        return None, f"its layout key {recorded} is not the {shape.key} its config has here"
    measured = probe_from_summary(summary, shape, val_batches=cfg.train.val_batches,
                                  async_save=cfg.checkpoint.async_save)  # fmt: skip
    probe = replace(measured, origin=origin)
    if not machine.store.add_probe(probe, keep_longer=True):
        stored = machine.store.probes[probe.key]
        return None, (f"the stored probe of this layout measured longer ({stored.measured_s:.3g} s of steps, "
                      f"{stored.origin}) than this run ({probe.measured_s:.3g} s)")  # fmt: skip
    return probe, ""
