"""StepProfiler: `train.profile_start_step` / `profile_num_steps` → `GaudiProfiler` over those optimizer steps.

Each rank writes `<out>/profile/trace-rank<R>.json` (Chrome trace: chrome://tracing or https://ui.perfetto.dev);
rank 0 also writes `summary.txt` (top ops by self time, peak memory). It only observes training.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl

from gaudi3_scale.monitor.profiler import GaudiProfiler

__all__ = ["StepProfiler"]


class StepProfiler:
    """Steps the profiler at every optimizer-step boundary and writes its outputs once the window has run.

    The trace names the recorded steps `ProfilerStep#N`, N counted from the step this fit started at (the global
    step in a fresh run). One step before the window is a warmup step, so profiler start-up stays out of it.
    """

    def __init__(
        self,
        out_dir: Path,
        *,
        start_step: int,
        num_steps: int,
        accelerator: str,
        note: Callable[[str], None],
        warn: Callable[[str], None],
    ) -> None:
        self.out_dir = out_dir
        self.start_step = start_step
        self.end_step = start_step + num_steps
        self.activities = ["cpu", *([accelerator] if accelerator in ("cuda", "hpu") else []), "memory"]
        self.note = note  # a line for the user (not `log`: Lightning sets `callback.log` to the module's)
        self.warn = warn
        self.profiler: GaudiProfiler | None = None
        self._steps_left = 0

    def start(self, trainer: pl.Trainer) -> None:
        first = max(self.start_step, trainer.global_step)
        if first >= self.end_step:
            self.warn(
                f"train.profile_start_step: steps {self.start_step}..{self.end_step - 1} ran before this fit "
                f"resumed at step {trainer.global_step}; nothing is profiled"
            )
            return
        lead = first - trainer.global_step
        warmup = min(1, lead)
        self.profiler = GaudiProfiler(
            self.activities,
            schedule_wait=lead - warmup,
            schedule_warmup=warmup,
            schedule_active=self.end_step - first,
        ).__enter__()
        self._steps_left = self.end_step - trainer.global_step

    def after_step(self, trainer: pl.Trainer) -> None:
        if self.profiler is None:
            return
        self.profiler.step()
        self._steps_left -= 1
        if self._steps_left == 0:
            self._finish(trainer)

    def end(self, trainer: pl.Trainer) -> None:
        if (
            self.profiler is not None
        ):  # stopped before the window ended (interrupt, budget): what was recorded
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
            self.warn(f"train.profile_start_step: training stopped before step {self.start_step}; no trace")
            return
        out = self.out_dir / "profile"
        trace = profiler.export_chrome_trace(out / f"trace-rank{trainer.global_rank}.json")
        if trainer.is_global_zero:
            (out / "summary.txt").write_text(profiler.summary() + "\n")
            self.note(f"profile: {trace} (Chrome trace), {out / 'summary.txt'}")
