"""GaudiProfiler around real steps of a small model, and `gaudi3 train --profile` on the bundled corpus (CPU)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.device.hpu import hpu_available
from gaudi3_scale.profiler import GaudiProfiler

pytestmark = pytest.mark.integration

GAUDI3 = [sys.executable, "-m", "gaudi3_scale.cli"]
TINY_RUN = ["--model.num_layers", "1", "--train.threads", "1", "--sample-tokens", "0", "--no-progress"]


def _train_steps(profiler: GaudiProfiler, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = model(torch.randn(16, 32)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        profiler.step()


def _profiled_steps(trace: dict) -> list[int]:
    names = {e["name"] for e in trace["traceEvents"]}
    return sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"ProfilerStep#(\d+)", n)))


def test_trace_holds_our_ops_from_the_active_window_only(tmp_path: Path) -> None:
    with GaudiProfiler(["cpu"], schedule_wait=1, schedule_warmup=1, schedule_active=3) as profiler:
        _train_steps(profiler, 7)
    path = profiler.export_chrome_trace(tmp_path / "nested" / "trace.json")  # after the context has exited
    trace = json.loads(path.read_text())
    assert _profiled_steps(trace) == [
        2,
        3,
        4,
    ]  # wait step 0, warmup step 1, then 3 active; steps 5, 6 dropped
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"aten::addmm", "aten::mm", "Optimizer.step#SGD.step"} <= names
    assert "[memory]" not in names  # memory was not asked for


def test_summary_table_and_memory_columns(capsys: pytest.CaptureFixture[str]) -> None:
    with GaudiProfiler(["cpu"], schedule_wait=0, schedule_warmup=1, schedule_active=2) as plain:
        _train_steps(plain, 3)
    with GaudiProfiler(["cpu", "memory"], schedule_wait=0, schedule_warmup=1, schedule_active=2) as memory:
        _train_steps(memory, 3)
    plain.print_summary(row_limit=5)
    out = capsys.readouterr().out
    assert re.search(r"Name\s+Self CPU %\s+Self CPU\s+CPU total %", out) and "aten::addmm" in out
    assert "CPU Mem" not in out and "peak memory" not in out
    memory.print_summary(row_limit=5)
    out = capsys.readouterr().out
    assert "Self CPU Mem" in out
    peak = memory.peak_memory_bytes()
    # At least the activations of one step: 16×64 and 16×8 float32 outputs, plus gradients of the 32×64 weight.
    assert peak >= (16 * 64 + 32 * 64) * 4, peak
    assert f"peak memory: {peak / 2**20:.2f} MiB allocated" in out


@pytest.mark.parametrize(
    ("activity", "present", "message"),
    [
        (
            "hpu",
            hpu_available,
            r"'hpu' requires Gaudi .*not yet validated on Gaudi hardware.*available here: cpu",
        ),
        ("cuda", torch.cuda.is_available, r"'cuda' needs a CUDA GPU.*available here: cpu"),
        ("tpu", lambda: False, r"unknown \['tpu'\]; allowed: cpu, cuda, hpu, memory"),
    ],
)
def test_unavailable_activity_is_one_clear_error(activity: str, present, message: str) -> None:
    if present():
        pytest.skip(f"{activity} is available here")
    with pytest.raises(UserInputError, match=message) as info:
        GaudiProfiler(["cpu", activity])
    assert "\n" not in str(info.value)


def test_export_before_the_window_ran_is_an_error(tmp_path: Path) -> None:
    with GaudiProfiler(["cpu"], schedule_wait=5, schedule_warmup=1, schedule_active=1) as profiler:
        _train_steps(profiler, 3)
    assert not profiler.recorded
    with pytest.raises(
        RuntimeError, match="recorded no step: the window starts at step 6 but only 3 steps ran"
    ):
        profiler.export_chrome_trace(tmp_path / "trace.json")


def test_gaudi3_train_profile_writes_a_trace_of_the_window(tmp_path: Path) -> None:
    # `--profile` alone (the 5:10 window) followed by an override: click must not take the override as its value.
    result = subprocess.run(
        [*GAUDI3, "train", "--out", str(tmp_path), "--profile", "--train.max_steps", "12", *TINY_RUN],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    trace_path = tmp_path / "profile" / "trace-rank0.json"
    assert f"profile: {trace_path}" in " ".join(result.stderr.split())
    trace = json.loads(trace_path.read_text())
    assert _profiled_steps(trace) == [5, 6, 7, 8, 9]
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"aten::mm", "[memory]"} <= names and any(n.startswith("Optimizer.step#AdamW") for n in names)
    summary = (tmp_path / "profile" / "summary.txt").read_text()
    assert "Self CPU Mem" in summary and "peak memory:" in summary


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--profile", "10:20"], "train.profile_start_step: steps 10..19 go past the last step, 11"),
        (["--profile", "7"], "--profile: expected START:END"),
        (["--train.profile_start_step", "-1"], "train.profile_start_step: must be >= 0, got -1"),
    ],
)
def test_bad_profile_window_is_one_line_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = subprocess.run(
        [*GAUDI3, "train", "--out", str(tmp_path), "--train.max_steps", "12", *args, *TINY_RUN],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "profile").exists()
