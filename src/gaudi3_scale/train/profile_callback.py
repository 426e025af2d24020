"""StepProfiler: `train.profile_start_step` / `profile_num_steps` → `GaudiProfiler` over those optimizer steps.

The outputs are named by the window they hold (`trace_path`, `summary_path`), so a resumed run that profiles
another window keeps the earlier ones: each rank writes `<out>/profile/trace-rank<R>-steps<S>-<E>.json` (Chrome
trace of optimizer steps S..E-1: chrome://tracing or https://ui.perfetto.dev), rank 0 also
`summary-steps<S>-<E>.txt` (top ops by self time, the window's peak net allocation). The trace labels each step
`ProfilerStep#N` with its global step number, in a resumed fit too.

Steps run under the profiler are slower: metrics.jsonl times them as they ran, but summary.json's throughput leaves
them out (`RunMetrics.book_profiled`; summary.json `profiled_steps` counts them), and writing the outputs is
paused time, as a checkpoint save is. It only observes training.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl

from gaudi3_scale.monitor.profiler import GaudiProfiler
from gaudi3_scale.train.step_metrics import RunMetrics

__all__ = ["PROFILE_DIR", "StepProfiler", "summary_path", "trace_path"]

PROFILE_DIR = "profile"


def trace_path(out_dir: Path, *, rank: int | str, start_step: int, end_step: int) -> Path:
    """Rank `rank`'s Chrome trace of optimizer steps start_step..end_step-1 (`rank="*"`: the glob of every rank's)."""
    return out_dir / PROFILE_DIR / f"trace-rank{rank}-steps{start_step}-{end_step}.json"


def summary_path(out_dir: Path, *, start_step: int, end_step: int) -> Path:
    """Rank 0's summary (top ops, peak net allocation) of optimizer steps start_step..end_step-1."""
    return out_dir / PROFILE_DIR / f"summary-steps{start_step}-{end_step}.txt"


class StepProfiler:
    """Steps the profiler at every optimizer-step boundary and writes its outputs once the window has run.

    One step before the window is the profiler's warmup step, so its start-up stays out of the window; a window
    that starts where the fit does (step 0, or the step a resume starts at) has none, and says so.
    """

    def __init__(
        self,
        out_dir: Path,
        *,
        start_step: int,
        num_steps: int,
        accelerator: str,
        metrics: RunMetrics | None,
        note: Callable[[str], None],
        warn: Callable[[str], None],
    ) -> None:
        self.out_dir = out_dir
        self.start_step = start_step
        self.end_step = start_step + num_steps
        # the first step this fit records (later in a fit resumed inside the window)
        self.first_step = start_step
        self.activities = ["cpu", *([accelerator] if accelerator in ("cuda", "hpu") else []), "memory"]
        self.metrics = metrics  # books the profiled steps apart, and is paused while the outputs are written
        self.note = note  # a line for the user (not `log`: Lightning sets `callback.log` to the module's)
        self.warn = warn
        self.profiler: GaudiProfiler | None = None
        self._profiled_from = start_step  # the first step run under the profiler (its warmup step, if any)

    def start(self, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        self.first_step = max(self.start_step, step)
        if self.first_step >= self.end_step:
            self.warn(
                f"train.profile_start_step: steps {self.start_step}..{self.end_step - 1} ran before this fit "
                f"resumed at step {step}; nothing is profiled"
            )
            return
        lead = self.first_step - step
        warmup = min(1, lead)
        if not warmup:
            self.warn(
                f"train.profile_start_step: step {self.first_step} is this fit's first, so no step before it warms "
                f"the profiler up: ProfilerStep#{self.first_step} also times the profiler's start-up"
                + (" and the data loader's" if step == 0 else "")
            )
        self.profiler = GaudiProfiler(
            self.activities,
            schedule_wait=lead - warmup,
            schedule_warmup=warmup,
            schedule_active=self.end_step - self.first_step,
            first_step_num=step,  # ProfilerStep#N: the global step
        ).__enter__()
        self._profiled_from = self.first_step - warmup
        self._book_profiled(next_step=step)

    def _book_profiled(self, *, next_step: int) -> None:
        if self.metrics is not None and next_step == self._profiled_from:
            self.metrics.book_profiled(True)

    def after_step(self, trainer: pl.Trainer) -> None:
        if self.profiler is None:
            return
        if trainer.global_step < self.end_step:
            self.profiler.step()
            self._book_profiled(next_step=trainer.global_step)
            return
        # The window's last step: torch stops tracing in this `step()`, then the outputs are written; that work
        # is no step's time (paused, as a checkpoint save is).
        if self.metrics is not None:
            self.metrics.book_profiled(False)
            self.metrics.pause()
        try:
            self.profiler.step()
            self._finish(trainer)
        finally:
            if self.metrics is not None:
                self.metrics.resume()

    def end(self, trainer: pl.Trainer) -> None:
        if (
            self.profiler is not None
        ):  # stopped before the window ended (interrupt, budget): the finished steps
            self._finish(trainer)

    def abort(self) -> None:
        if self.profiler is not None:  # an exception ended training: stop profiling, write nothing
            profiler, self.profiler = self.profiler, None
            profiler.__exit__(None, None, None)

    def _finish(self, trainer: pl.Trainer) -> None:
        profiler, self.profiler = self.profiler, None
        assert profiler is not None
        profiler.__exit__(None, None, None)
        if not profiler.recorded:
            self.warn(f"train.profile_start_step: training stopped before step {self.first_step}; no trace")
            return
        window = {"start_step": self.first_step, "end_step": self.end_step}
        trace = profiler.export_chrome_trace(trace_path(self.out_dir, rank=trainer.global_rank, **window))
        if not trainer.is_global_zero:
            return
        summary = summary_path(self.out_dir, **window)
        summary.write_text(profiler.summary() + "\n")
        if trainer.world_size > 1:
            traces = f"{trace_path(self.out_dir, rank='*', **window)} (a Chrome trace per rank)"
        else:
            traces = f"{trace} (Chrome trace)"
        self.note(f"profile: {traces}, {summary}{self._held(trainer.global_step)}")

    def _held(self, step: int) -> str:
        """What the outputs hold when training stopped inside the window (`step`: steps run): the finished steps."""
        if step >= self.end_step:
            return ""
        held = f"step {step - 1}" if step - 1 == self.first_step else f"steps {self.first_step}..{step - 1}"
        return f"; training stopped inside the window: they hold {held} of {self.first_step}..{self.end_step - 1}"
