"""`GaudiProfiler`: `torch.profiler` over a window of steps, with a Chrome trace and a top-ops summary.

    with GaudiProfiler(activities=["cpu", "memory"], schedule_wait=1, schedule_warmup=1, schedule_active=3) as prof:
        for batch in batches:
            train_step(batch)
            prof.step()
    prof.export_chrome_trace("trace.json")  # open in chrome://tracing or https://ui.perfetto.dev
    prof.print_summary()

Steps are numbered from `first_step_num` (0 unless told) at `__enter__`; only steps wait+warmup …
wait+warmup+active-1 after it are recorded (the warmup steps run the profiler but drop their events, so its
start-up cost stays out of the window; with `schedule_warmup=0` the first recorded step carries it), and the trace
names each recorded step `ProfilerStep#N`. A loop that stops inside the window (fewer steps than the schedule, an
interrupt) leaves torch a step it opened but never finished; it is left out of the trace and the summary, which
hold the finished steps only. The "hpu" activity is not yet validated on Gaudi hardware.
"""

from __future__ import annotations

import gzip
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerAction, ProfilerActivity

from gaudi3_scale.config.errors import UserInputError

__all__ = ["ACTIVITIES", "GaudiProfiler"]

ACTIVITIES = ("cpu", "cuda", "hpu", "memory")
_RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)


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


def _schedule(wait: int, warmup: int, active: int, first_step_num: int) -> Any:
    """torch's wait/warmup/active schedule (repeat once), counted from step `first_step_num`. torch evaluates it
    at step 0 when it is built, before `step_num` is set to `first_step_num`: earlier steps read as the first."""
    with warnings.catch_warnings():
        # torch warns about warmup 0 from inside this module; the module docstring says what it means instead.
        warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
        base = torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1)
    return lambda step: base(max(step - first_step_num, 0))


class GaudiProfiler:
    """A context manager over `torch.profiler.profile` with a wait/warmup/active schedule (repeat once)."""

    def __init__(
        self,
        activities: Sequence[str] = ("cpu",),
        *,
        schedule_wait: int = 1,
        schedule_warmup: int = 1,
        schedule_active: int = 3,
        first_step_num: int = 0,
    ) -> None:
        if schedule_wait < 0 or schedule_warmup < 0 or schedule_active < 1 or first_step_num < 0:
            raise UserInputError(
                "profiler schedule: wait, warmup and first_step_num must be >= 0 and active >= 1, got "
                f"{schedule_wait}/{schedule_warmup}/{schedule_active}/{first_step_num}"
            )
        self.activities = list(activities)
        self.profile_memory = "memory" in self.activities
        # the number torch gives the step at `__enter__` (ProfilerStep#N)
        self.first_step_num = first_step_num
        self.first_step = first_step_num + schedule_wait + schedule_warmup  # the first recorded step's number
        self.active_steps = schedule_active
        self._prof = torch.profiler.profile(
            activities=_torch_activities(self.activities),
            schedule=_schedule(schedule_wait, schedule_warmup, schedule_active, first_step_num),
            profile_memory=self.profile_memory,
            record_shapes=self.profile_memory,
        )
        self._prof.step_num = first_step_num
        self._recorded = False
        # a recording step torch opened that never ended (see docstring)
        self._unfinished_step: int | None = None
        self._events_pruned = False

    def __enter__(self) -> GaudiProfiler:
        # No torch.cuda.reset_peak_memory_stats(): that counter is the process's (the run's reported peak memory
        # reads it); the window's own peak is `peak_memory_bytes`, from the profiler's memory events.
        self._prof.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._prof.current_action in _RECORDING:  # torch opened ProfilerStep#<step_num>; it never finished
            self._unfinished_step = self._prof.step_num
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
            ran = self._prof.step_num - self.first_step_num
            raise RuntimeError(
                f"the profiler recorded no step: the window starts at step {self.first_step} but only "
                f"{ran} steps ran" + (f" from step {self.first_step_num}" if self.first_step_num else "")
            )
        return self._prof

    def _unfinished_name(self) -> str | None:
        return None if self._unfinished_step is None else f"ProfilerStep#{self._unfinished_step}"

    def export_chrome_trace(self, path: str | Path) -> Path:
        """Write the recorded window as Chrome trace JSON (works inside the context and after it); a path ending
        in .gz is gzipped, as torch does."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._results().export_chrome_trace(str(path))
        if (name := self._unfinished_name()) is not None:
            _drop_events(path, name)
        return path

    def _events(self) -> Any:
        """The recorded events, without the span of a step that never finished (once: torch's list, in place)."""
        events = self._results().events()
        name = self._unfinished_name()
        if name is not None and not self._events_pruned:
            events[:] = [
                e for e in events if e.trace_name != name
            ]  # `name` says "ProfilerStep*" for every step
            self._events_pruned = True
        return events

    def summary(self, row_limit: int = 15) -> str:
        """Top ops by self time (device time when a device was profiled), then the window's peak net allocation
        when memory is on."""
        events = self._events()
        on_device = "cuda" in self.activities or "hpu" in self.activities
        sort_by = "self_device_time_total" if on_device else "self_cpu_time_total"
        lines = [events.key_averages().table(sort_by=sort_by, row_limit=row_limit)]
        if self.profile_memory:
            lines.append(
                f"peak net allocation in the window: {self.peak_memory_bytes() / 2**20:.2f} MiB on "
                f"{self._memory_device()} (allocations minus frees from the window's start, not the process's peak)"
            )
        return "\n".join(lines)

    def print_summary(self, row_limit: int = 15) -> None:
        print(self.summary(row_limit))

    def _memory_device(self) -> str:
        return next((d for d in ("cuda", "hpu") if d in self.activities), "cpu")

    def peak_memory_bytes(self) -> int:
        """The highest net allocation during the recorded window on the profiled device (CUDA or HPU when profiled,
        else the CPU): the running sum of the profiler's allocation events, which frees subtract, counted from 0 at
        the window's start, so memory held before it (weights, optimizer state) is not in it. It reads no device
        counter and resets none. Only the finished steps count (not a step the loop never finished). The CUDA
        and HPU paths are not yet validated on hardware."""
        device = {"cuda": DeviceType.CUDA, "hpu": DeviceType.HPU, "cpu": DeviceType.CPU}[
            self._memory_device()
        ]
        kineto = self._results().profiler.kineto_results.events()
        end_ns = min((e.start_ns() for e in kineto if e.name() == self._unfinished_name()), default=None)
        events = [
            e
            for e in kineto
            if e.name() == "[memory]"
            and e.device_type() == device
            and (end_ns is None or e.start_ns() < end_ns)
        ]
        net = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            net += event.nbytes()
            peak = max(peak, net)
        return peak


def _drop_events(path: Path, name: str) -> None:
    """Rewrite the Chrome trace at `path` without the events named `name` (host and device annotations)."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    trace["traceEvents"] = [e for e in trace.get("traceEvents", []) if e.get("name") != name]
    with opener(path, "wt") as f:
        json.dump(trace, f)
