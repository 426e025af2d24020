"""`GaudiProfiler`'s window through its public API, on real steps of a small model (CPU): a loop that stops inside
the window leaves no step that never ran in the trace or the summary, steps are numbered from `first_step_num`
(a resumed fit's global step), and the process-wide CUDA peak counter is left alone."""

from __future__ import annotations

import gzip
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from gaudi3_scale.profiler import GaudiProfiler


def _steps(profiler: GaudiProfiler, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    for _ in range(steps):
        model(torch.randn(16, 32)).square().mean().backward()
        profiler.step()


def _trace_steps(path: Path) -> list[str]:
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    events = json.loads(text)["traceEvents"]
    return sorted(str(e["name"]) for e in events if str(e.get("name", "")).startswith("ProfilerStep#"))


def _summary_step_count(summary: str) -> int:
    """The "# of Calls" of the summary table's ProfilerStep* row (its last column)."""
    row = next(line for line in summary.splitlines() if line.strip().startswith("ProfilerStep*"))
    return int(row.split()[-1])


@pytest.mark.parametrize("name", ["trace.json", "trace.json.gz"])  # torch gzips a .gz path
def test_a_window_cut_short_holds_only_the_steps_that_ran(tmp_path: Path, name: str) -> None:
    # wait 1, warmup 1, active 3, but the loop stops after 3 steps: step 2 is the one recorded step that finished;
    # torch opened ProfilerStep#3 at the last step() and closed it at exit, with no step in it.
    with GaudiProfiler(["cpu", "memory"], schedule_wait=1, schedule_warmup=1, schedule_active=3) as profiler:
        _steps(profiler, 3)
    assert profiler.recorded
    assert _trace_steps(profiler.export_chrome_trace(tmp_path / name)) == ["ProfilerStep#2"]
    assert _summary_step_count(profiler.summary()) == 1


def test_a_full_window_is_unchanged(tmp_path: Path) -> None:
    with GaudiProfiler(["cpu"], schedule_wait=1, schedule_warmup=1, schedule_active=3) as profiler:
        _steps(profiler, 5)  # the window ends with the loop: no step left open
    assert _trace_steps(profiler.export_chrome_trace(tmp_path / "trace.json")) == [
        "ProfilerStep#2",
        "ProfilerStep#3",
        "ProfilerStep#4",
    ]
    assert _summary_step_count(profiler.summary()) == 3


def test_steps_are_numbered_from_first_step_num(tmp_path: Path) -> None:
    """A fit resumed at step 100 that profiles steps 102..103: the trace names them as the run counts them."""
    with GaudiProfiler(
        ["cpu"], schedule_wait=1, schedule_warmup=1, schedule_active=2, first_step_num=100
    ) as profiler:
        _steps(profiler, 4)
    assert _trace_steps(profiler.export_chrome_trace(tmp_path / "trace.json")) == [
        "ProfilerStep#102",
        "ProfilerStep#103",
    ]


def test_no_warmup_step_warns_nothing_from_torch() -> None:
    """torch warns about warmup 0 from inside our module (a file path the user did not write); the docstring
    says what it means instead."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GaudiProfiler(["cpu"], schedule_wait=0, schedule_warmup=0, schedule_active=1) as profiler:
            _steps(profiler, 1)
    assert profiler.recorded and [str(w.message) for w in caught] == []


def test_the_summary_names_its_memory_figure_for_what_it_is() -> None:
    with GaudiProfiler(["cpu", "memory"], schedule_wait=0, schedule_warmup=1, schedule_active=2) as profiler:
        _steps(profiler, 3)
    peak = profiler.peak_memory_bytes()
    assert peak >= 16 * 64 * 4  # at least one step's 16×64 float32 activations
    line = profiler.summary().splitlines()[-1]
    assert re.fullmatch(
        rf"peak net allocation in the window: {peak / 2**20:.2f} MiB on cpu \(allocations minus frees from the "
        r"window's start, not the process's peak\)",
        line,
    ), line


def test_entering_leaves_the_process_cuda_peak_counter_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's peak memory on CUDA is torch.cuda.max_memory_allocated() since the process began (monitor.perf):
    a profiler of the CPU must not reset it. No GPU here: torch.cuda is a stand-in that says one is visible and
    records resets (the CUDA path itself is not validated on a GPU)."""
    resets: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: resets.append(a))
    with GaudiProfiler(["cpu"], schedule_wait=0, schedule_warmup=1, schedule_active=1) as profiler:
        _steps(profiler, 2)
    assert resets == []
