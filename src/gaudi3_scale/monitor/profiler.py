"""`GaudiProfiler`: `torch.profiler` over a window of steps, with a Chrome trace and a top-ops summary.

    with GaudiProfiler(activities=["cpu", "memory"], schedule_wait=1, schedule_warmup=1, schedule_active=3) as prof:
        for batch in batches:
            train_step(batch)
            prof.step()
    prof.export_chrome_trace("trace.json")  # open in chrome://tracing or https://ui.perfetto.dev
    prof.print_summary()

Steps are counted from 0 at `__enter__`; only steps wait+warmup … wait+warmup+active-1 are recorded (the warmup
steps run the profiler but drop their events, so its start-up cost stays out of the window), and the trace names
each recorded step `ProfilerStep#N`. The "hpu" activity is not yet validated on Gaudi hardware.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.profiler import ProfilerActivity

from gaudi3_scale.config.errors import UserInputError

__all__ = ["ACTIVITIES", "GaudiProfiler"]

ACTIVITIES = ("cpu", "cuda", "hpu", "memory")


def _available_activities() -> list[str]:
    from gaudi3_scale.device.hpu import hpu_available

    return [
        "cpu",
        *(["cuda"] if torch.cuda.is_available() else []),
        *(["hpu"] if hpu_available() else []),
        "memory",
    ]


def _torch_activities(activities: Sequence[str]) -> list[ProfilerActivity]:
    """Our names → torch's; a device that is not here is one line naming what is."""
    unknown = [a for a in activities if a not in ACTIVITIES]
    if unknown or not activities:
        raise UserInputError(
            f"profiler activities: unknown {unknown or '(none)'}; allowed: {', '.join(ACTIVITIES)}"
        )
    chosen = [ProfilerActivity.CPU] if "cpu" in activities else []
    if "cuda" in activities:
        if not torch.cuda.is_available():
            raise UserInputError(
                f"profiler activity 'cuda' needs a CUDA GPU and none is visible; available here: "
                f"{', '.join(_available_activities())}"
            )
        chosen.append(ProfilerActivity.CUDA)
    if "hpu" in activities:
        from gaudi3_scale.device.hpu import hpu_available

        if not hpu_available():
            raise UserInputError(
                "profiler activity 'hpu' requires Gaudi (habana_frameworks with a visible HPU; not yet validated "
                f"on Gaudi hardware); available here: {', '.join(_available_activities())}"
            )
        chosen.append(ProfilerActivity.HPU)  # docs.habana.ai "Profiling with PyTorch"
    return chosen or [ProfilerActivity.CPU]  # "memory" alone: allocations are seen by the CPU activity


class GaudiProfiler:
    """A context manager over `torch.profiler.profile` with a wait/warmup/active schedule (repeat once)."""

    def __init__(
        self,
        activities: Sequence[str] = ("cpu",),
        *,
        schedule_wait: int = 1,
        schedule_warmup: int = 1,
        schedule_active: int = 3,
    ) -> None:
        if schedule_wait < 0 or schedule_warmup < 0 or schedule_active < 1:
            raise UserInputError(
                "profiler schedule: wait and warmup must be >= 0 and active >= 1, got "
                f"{schedule_wait}/{schedule_warmup}/{schedule_active}"
            )
        self.activities = list(activities)
        self.profile_memory = "memory" in self.activities
        self.first_step = schedule_wait + schedule_warmup
        self.active_steps = schedule_active
        self._prof = torch.profiler.profile(
            activities=_torch_activities(self.activities),
            schedule=torch.profiler.schedule(
                wait=schedule_wait, warmup=schedule_warmup, active=schedule_active, repeat=1
            ),
            profile_memory=self.profile_memory,
            record_shapes=self.profile_memory,
        )
        self._recorded = False

    def __enter__(self) -> GaudiProfiler:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._prof.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._prof.__exit__(exc_type, exc, tb)

    def step(self) -> None:
        """Mark the end of one step (call it once per training step, after the optimizer)."""
        self._prof.step()
        # The window has recorded once the profiler has entered its first active step.
        self._recorded = self._recorded or self._prof.step_num > self.first_step

    @property
    def recorded(self) -> bool:
        """Whether at least one step of the active window has completed (so there is something to export)."""
        return self._recorded

    def _results(self) -> Any:
        if not self._recorded or self._prof.profiler is None:
            raise RuntimeError(
                f"the profiler recorded no step: the window starts at step {self.first_step} but only "
                f"{self._prof.step_num} steps ran"
            )
        return self._prof

    def export_chrome_trace(self, path: str | Path) -> Path:
        """Write the recorded window as Chrome trace JSON (works inside the context and after it)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._results().export_chrome_trace(str(path))
        return path

    def summary(self, row_limit: int = 15) -> str:
        """Top ops by self time (device time when a device was profiled), then peak memory when memory is on."""
        prof = self._results()
        on_device = "cuda" in self.activities or "hpu" in self.activities
        sort_by = "self_device_time_total" if on_device else "self_cpu_time_total"
        lines = [prof.key_averages().table(sort_by=sort_by, row_limit=row_limit)]
        if self.profile_memory:
            lines.append(f"peak memory: {self.peak_memory_bytes() / 2**20:.2f} MiB allocated")
        return "\n".join(lines)

    def print_summary(self, row_limit: int = 15) -> None:
        print(self.summary(row_limit))

    def peak_memory_bytes(self) -> int:
        """Peak allocated CUDA memory since `__enter__`; without CUDA, the highest net allocation during the
        recorded window (the running sum of the profiler's allocation events, which free memory subtracts)."""
        if "cuda" in self.activities:
            return int(torch.cuda.max_memory_allocated())
        events = [e for e in self._results().profiler.kineto_results.events() if e.name() == "[memory]"]
        net = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            net += event.nbytes()
            peak = max(peak, net)
        return peak
