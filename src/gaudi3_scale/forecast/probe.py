"""The calibration probe (`gaudi3 plan --probe`): a short real `gaudi3 train` of the same config and layout on this
machine — warm-up steps, measured steps and the final validation; no checkpoint (it keeps nothing), so a save's time
stays the forecast's model — whose measurements go into the machine's calibration store (`forecast.calibration`)
and from there into every later forecast of that layout.

A probe that fails (out of memory, a crash, a timeout) is said in one line and the forecast falls back to the
catalog; nothing is stored."""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from gaudi3_scale.forecast.calibration import Probe
from gaudi3_scale.forecast.shape import RunShape
from gaudi3_scale.train.config import throwaway_run_overrides

__all__ = ["PROBE_MEASURED_S", "PROBE_MEASURED_STEPS", "probe_measured_steps", "run_probe"]

PROBE_MEASURED_STEPS = 10  # at least this many measured steps
PROBE_MAX_MEASURED_STEPS = 300  # at most (a very fast step)
PROBE_MEASURED_S = (
    10.0  # measured time the probe aims at: on a 2-core CPU, 10 steps of 40 ms scatter by ±15 %
)


def probe_measured_steps(predicted_step_s: float | None) -> int:
    """How many steps the probe measures: enough for ~`PROBE_MEASURED_S` seconds of steady steps at the catalog's
    predicted step time (the mean of a few short steps is mostly noise), between 10 and 300."""
    if not predicted_step_s or predicted_step_s <= 0:
        return PROBE_MEASURED_STEPS
    wanted = math.ceil(PROBE_MEASURED_S / predicted_step_s)
    return max(PROBE_MEASURED_STEPS, min(PROBE_MAX_MEASURED_STEPS, wanted))


def probe_command(
    config_path: str | None,
    overrides: tuple[str, ...],
    out: Path,
    *,
    warmup_steps: int,
    measured_steps: int,
    spike_policy: str = "warn",
) -> list[str]:
    """`gaudi3 train` of the config with the probe's own length and outputs (what the run would do, shorter)."""
    return [
        sys.executable, "-m", "gaudi3_scale.cli", "train", *(["--config", config_path] if config_path else []),
        *overrides, "--out", str(out), "--resume", "never", "--sample-tokens", "0", "--no-progress",
        "--train.max_steps", str(warmup_steps + measured_steps),
        "--train.throughput_warmup_steps", str(warmup_steps),
        "--train.val_every_steps", "0",
        # its length is steps (a train.max_epochs unset), no profiler; nothing of the probe leaves its temporary
        # directory: no checkpoint (none uploaded to the run's remote), no tracker run, no metrics port
        *throwaway_run_overrides(spike_policy=spike_policy),
    ]  # fmt: skip


def run_probe(
    config_path: str | None,
    overrides: tuple[str, ...],
    shape: RunShape,
    *,
    val_batches: int,
    warmup_steps: int,
    measured_steps: int = PROBE_MEASURED_STEPS,
    timeout_s: float = 1800.0,
    spike_policy: str = "warn",
) -> tuple[Probe | None, str]:
    """(the probe, "") or (None, why it failed: one line). `spike_policy`: the config's `health.spike_policy`."""
    from gaudi3_scale.distributed.jobs import run_job

    with tempfile.TemporaryDirectory(prefix="gaudi3-probe-") as tmp:
        out = Path(tmp) / "run"
        command = probe_command(config_path, overrides, out, warmup_steps=warmup_steps,
                                measured_steps=measured_steps, spike_policy=spike_policy)  # fmt: skip
        outcome = run_job(command, Path(tmp) / "probe.log", timeout_s=timeout_s)
        summary_path = out / "summary.json"
        if not summary_path.is_file():
            log = (Path(tmp) / "probe.log").read_text(errors="replace").strip().splitlines()
            last = next((line for line in reversed(log) if line.strip()), "no output")
            oom = any("out of memory" in line.lower() or "memoryerror" in line.lower() for line in log)
            why = "out of memory" if oom else f"{outcome.status}: {last[-300:]}"
            return None, f"the probe run failed ({why})"
        summary = json.loads(summary_path.read_text())
    return probe_from_summary(summary, shape, val_batches=val_batches), ""


def probe_from_summary(
    summary: dict[str, Any], shape: RunShape, *, val_batches: int, async_save: bool | None = None
) -> Probe:
    """A probe's measurements from its run's summary.json: the steady step, the warm-up, one save's blocking
    time (made as `async_save` says: its run's checkpoint.async_save), the peak memory; its validation pass from
    its measured rate (forward FLOPs ÷ the step's achieved rate); startup is the rest of its wall time."""
    step = float(summary["step_time_s"])
    measured_steps = int(summary.get("measured_steps") or 0)
    warmup_s = float(summary.get("warmup_s") or 0.0)
    saves = [float(s) for s in summary.get("checkpoint_blocking_s") or []]  # the newest saves
    longest = summary.get("checkpoint_blocking_max_s")  # all of them (summaries since 2026-11-30)
    checkpoint_s = float(longest) if longest is not None else max(saves) if saves else None
    flops = shape.flops_per_step_per_rank()
    validation_s = shape.validation_flops_per_rank(val_batches) / (flops / step)
    wall = float(summary["wall_s"])
    startup = max(0.0, wall - warmup_s - measured_steps * step - validation_s - (checkpoint_s or 0.0))
    return Probe(
        key=shape.key,
        layout=shape.layout(),
        step_time_s=step,
        warmup_s=warmup_s,
        warmup_steps=int(summary.get("warmup_steps") or 0),
        startup_s=startup,
        validation_s=validation_s,
        checkpoint_s=checkpoint_s,
        checkpoint_async_save=async_save if checkpoint_s is not None else None,
        peak_memory_bytes=int(summary["peak_memory_bytes"]),
        flops_per_step_per_rank=flops,
        measured_steps=measured_steps,
    )
