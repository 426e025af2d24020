"""Reproducibility check: the same run trained twice, or stopped and resumed, must come out bit for bit the same.

`gaudi3 repro` plans two `gaudi3 train` runs (`plan_runs`), starts each as a subprocess (`run_training_process`)
and compares what they wrote (`compare_runs`): the per-step losses in `metrics.jsonl`, then the final checkpoint
with `first_difference`. Only values that are functions of the training state are compared; step times,
tokens/s and memory are measurements and may differ.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gaudi3_scale.checkpoint.inspect import Difference, first_difference
from gaudi3_scale.checkpoint.manager import CheckpointManager
from gaudi3_scale.checkpoint.reader import read_checkpoint
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.train.report import read_metrics

__all__ = [
    "COMPARED_FIELDS",
    "MODES",
    "Comparison",
    "MetricDifference",
    "ReproPlan",
    "RunSpec",
    "compare_runs",
    "first_metric_difference",
    "logged_step",
    "plan_runs",
    "read_step_metrics",
    "run_training_process",
]

MODES = ("twice", "resume")
COMPARED_FIELDS = ("train_loss", "grad_norm", "lr", "val_loss")  # metrics.jsonl fields that must not vary


@dataclass(frozen=True)
class RunSpec:
    name: str  # "A" or "B"
    label: str  # what the run is, e.g. "continuous" or "resumed from step 3"
    out_dir: Path
    resume: str  # train.resume: "never" (from scratch) or the checkpoint this run resumes from
    first_step: int  # optimizer steps already done when the run starts


@dataclass(frozen=True)
class ReproPlan:
    mode: str
    steps: int
    runs: tuple[RunSpec, RunSpec]
    checkpoint_every_steps: int  # 0 = only at the end; resume mode also saves the step run B resumes from
    compare_from_step: int  # steps compare_from_step..steps are compared; the checkpoint at `steps`
    note: str
    # The config uploads checkpoints: these throwaway runs must not (nor resume from the remote copy).
    clear_remote_url: bool = False

    def overrides(self) -> list[str]:
        """Appended after the user's overrides, so they win."""
        return [
            f"--train.max_steps={self.steps}",
            "--train.max_epochs=null",  # the runs compare a fixed number of steps
            "--train.log_every_steps=1",  # one record per step: each step's loss, not a window mean
            "--checkpoint.enabled=true",  # the runs' last checkpoints are compared, whatever the config says
            f"--checkpoint.every_steps={self.checkpoint_every_steps}",
            # Retention must not delete the checkpoint run B resumes from (0 = no such rule).
            f"--checkpoint.keep_every_steps={self.checkpoint_every_steps}",
            *(["--checkpoint.remote_url=''"] if self.clear_remote_url else []),
        ]

    def command(self, run: RunSpec, config_path: str | None, overrides: Sequence[str]) -> list[str]:
        """The `gaudi3 train` command line of one run."""
        return [
            *(sys.executable, "-m", "gaudi3_scale.cli", "train"),
            *(["--config", config_path] if config_path else []),
            *("--out", str(run.out_dir), "--resume", run.resume, "--sample-tokens", "0", "--no-progress"),
            *overrides,
            *self.overrides(),
        ]


def plan_runs(mode: str, steps: int, directory: Path, *, remote_url: str = "") -> ReproPlan:
    """Runs A and B under `directory` (run-a/, run-b/): both from scratch, or B resumed from A's step N//2.

    `remote_url` is the config's checkpoint.remote_url: the runs are throwaway, so they never upload there.
    """
    if mode not in MODES:
        raise UserInputError(f"--mode: got {mode!r}; allowed: {', '.join(MODES)}")
    if steps < 1 or (mode == "resume" and steps < 2):
        least = 2 if mode == "resume" else 1
        raise UserInputError(f"--steps: {mode} mode needs at least {least} steps, got {steps}")
    a_dir, b_dir = directory / "run-a", directory / "run-b"
    # B's first step, and checkpoint.every_steps (0 = only at the end): resume mode saves the step B starts from.
    half = steps // 2 if mode == "resume" else 0
    if mode == "twice":
        a = RunSpec(name="A", label="from scratch", out_dir=a_dir, resume="never", first_step=0)
        b = RunSpec(name="B", label="from scratch", out_dir=b_dir, resume="never", first_step=0)
        note = "runs A and B trained from scratch with the same config and seed"
    else:
        # There is no "stop at step K" switch, and a signal cannot land on an exact step; so B resumes, in a new
        # process, from the checkpoint A committed at step K (same max_steps, so the LR schedule is the same).
        resume_from = CheckpointManager(a_dir / "checkpoints").path_for(half)
        a = RunSpec(name="A", label="continuous", out_dir=a_dir, resume="never", first_step=0)
        b = RunSpec(name="B", label=f"resumed from step {half}", out_dir=b_dir, resume=str(resume_from),
                    first_step=half)  # fmt: skip
        note = f"run B resumed in a new process from run A's step-{half} checkpoint; steps {half + 1}-{steps} compared"
    return ReproPlan(mode=mode, steps=steps, runs=(a, b), checkpoint_every_steps=half, compare_from_step=half + 1,
                     note=note, clear_remote_url=bool(remote_url))  # fmt: skip


def run_training_process(command: Sequence[str], log_path: Path, *, poll: Callable[[], None]) -> int:
    """Run `command` with stdout and stderr into `log_path`, calling `poll` while it runs; its exit code."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT)
        try:
            while process.poll() is None:
                poll()
                time.sleep(0.25)
        finally:
            if process.poll() is None:  # we were interrupted: stop the run the way Ctrl-C would
                process.terminate()
                process.wait()
    return process.returncode


def logged_step(run_dir: Path) -> int | None:
    """The last step in a running run's metrics.jsonl (for progress), or None; a half-written line is skipped."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    complete = path.read_text().split("\n")[:-1]  # only lines with their newline
    return int(json.loads(complete[-1])["step"]) if complete else None


def read_step_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The compared fields of a finished run's metrics.jsonl, per step (train and validation records merged)."""
    steps: dict[int, dict[str, Any]] = {}
    for record in read_metrics(run_dir / "metrics.jsonl"):
        fields = {k: record[k] for k in COMPARED_FIELDS if k in record}
        steps.setdefault(int(record["step"]), {}).update(fields)
    return steps


@dataclass(frozen=True)
class MetricDifference:
    step: int
    field: str  # a COMPARED_FIELDS name, or "step" when one run logged no record for it
    a: Any
    b: Any

    def describe(self) -> str:
        if self.field == "step":
            return f"step {self.step}: logged by run A: {self.a}, by run B: {self.b}"
        return f"step {self.step}: {self.field} {self.a!r} vs {self.b!r}"


def _same(a: Any, b: Any) -> bool:
    nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return nan or (type(a) is type(b) and a == b)


def first_metric_difference(
    a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], steps: range
) -> MetricDifference | None:
    """The first step in `steps` where a compared field differs (exact float equality) or a record is missing."""
    for step in steps:
        if step not in a or step not in b:
            return MetricDifference(step, "step", step in a, step in b)
        for name in COMPARED_FIELDS:
            if not _same(a[step].get(name), b[step].get(name)):
                return MetricDifference(step, name, a[step].get(name), b[step].get(name))
    return None


@dataclass(frozen=True)
class Comparison:
    steps: range  # the steps whose metrics were compared
    metrics: MetricDifference | None
    checkpoints: tuple[Path, Path]  # A's and B's checkpoint at the last step
    checkpoint: Difference | None

    @property
    def identical(self) -> bool:
        return self.metrics is None and self.checkpoint is None

    def to_dict(self) -> dict[str, Any]:
        metrics = self.metrics
        return {
            "identical": self.identical,
            "steps_compared": [self.steps.start, self.steps.stop - 1],
            "compared_fields": list(COMPARED_FIELDS),
            "metrics_first_difference": None if metrics is None else {
                "step": metrics.step, "field": metrics.field, "a": metrics.a, "b": metrics.b,
                "description": metrics.describe()},
            "checkpoints": [str(path) for path in self.checkpoints],
            "checkpoint_first_difference": None if self.checkpoint is None else {
                "key": self.checkpoint.key, "detail": self.checkpoint.detail},
        }  # fmt: skip


def compare_runs(
    a_dir: Path, b_dir: Path, *, first_step: int, last_step: int, keys: tuple[str, ...]
) -> Comparison:
    """Compare two finished runs: metrics of steps first_step..last_step, then their checkpoints at last_step.

    `keys` are the checkpoint's top-level entries to compare bitwise (`gaudi3 ckpt diff` compares the same).
    """
    steps = range(first_step, last_step + 1)
    metrics = first_metric_difference(read_step_metrics(a_dir), read_step_metrics(b_dir), steps)
    paths = (
        CheckpointManager(a_dir / "checkpoints").path_for(last_step),
        CheckpointManager(b_dir / "checkpoints").path_for(last_step),
    )
    checkpoint = first_difference(read_checkpoint(paths[0]), read_checkpoint(paths[1]), keys=keys)
    return Comparison(steps=steps, metrics=metrics, checkpoints=paths, checkpoint=checkpoint)
