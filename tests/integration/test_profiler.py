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
    assert "CPU Mem" not in out and "peak net allocation" not in out
    memory.print_summary(row_limit=5)
    out = capsys.readouterr().out
    assert "Self CPU Mem" in out
    peak = memory.peak_memory_bytes()
    # At least the activations of one step: 16×64 and 16×8 float32 outputs, plus gradients of the 32×64 weight.
    assert peak >= (16 * 64 + 32 * 64) * 4, peak
    assert f"peak net allocation in the window: {peak / 2**20:.2f} MiB on cpu" in out


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


# `gaudi3 train` as the CLI runs it, with the profiler's summary made slow: a stand-in for writing a large model's
# outputs (the real summary, SLOW_SUMMARY_S later).
SLOW_SUMMARY_S = 5.0
SLOW_SUMMARY_GAUDI3 = [
    sys.executable,
    "-c",
    f"""import sys, time
from gaudi3_scale.monitor.profiler import GaudiProfiler
summary = GaudiProfiler.summary
def slow_summary(self, *args, **kwargs):
    time.sleep({SLOW_SUMMARY_S})
    return summary(self, *args, **kwargs)
GaudiProfiler.summary = slow_summary
from gaudi3_scale.cli.main import main
main(sys.argv[1:])
""",
]


def test_gaudi3_train_profile_writes_a_trace_of_the_window(tmp_path: Path) -> None:
    # `--profile` alone (the 5:10 window) followed by an override: click must not take the override as its value.
    args = ["train", "--out", str(tmp_path), "--profile", "--train.max_steps", "12", *TINY_RUN]
    result = subprocess.run(
        [*SLOW_SUMMARY_GAUDI3, *args, "--train.log_every_steps", "1"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    trace_path = tmp_path / "profile" / "trace-rank0-steps5-10.json"  # named by its window
    summary_path = tmp_path / "profile" / "summary-steps5-10.txt"
    assert f"profile: {trace_path} (Chrome trace), {summary_path}" in " ".join(result.stderr.split())
    trace = json.loads(trace_path.read_text())
    assert _profiled_steps(trace) == [5, 6, 7, 8, 9]
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"aten::mm", "[memory]"} <= names and any(n.startswith("Optimizer.step#AdamW") for n in names)
    summary = summary_path.read_text()
    assert "Self CPU Mem" in summary and "peak net allocation in the window:" in summary
    # Writing the outputs is paused time, as a checkpoint save is: no step after the warm-up holds the slow
    # summary (records are by the step count after the step: the window's outputs are written after record 10).
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step_times = {r["step"]: r["step_time_s"] for r in records if "step_time_s" in r}
    assert sorted(step_times) == list(range(1, 13))
    assert max(t for step, t in step_times.items() if step > 2) < SLOW_SUMMARY_S / 2, step_times
    # Steps run under the profiler are slower: summary.json's throughput leaves them out and counts them. The
    # warm-up is steps 0 and 1; the profiler's warmup step 4 and the window 5..9 are profiled; 2, 3, 10, 11 measured.
    run = json.loads((tmp_path / "summary.json").read_text())
    assert (run["warmup_steps"], run["profiled_steps"], run["measured_steps"]) == (2, 6, 4)
    assert run["step_time_s"] < SLOW_SUMMARY_S / 2


@pytest.mark.distributed  # the first run has two ranks
def test_a_resumed_run_profiles_another_window_beside_the_first(tmp_path: Path) -> None:
    """Two ranks profile steps 0..1; a single-rank resume profiles step 4. Nothing is overwritten, and each trace
    labels its steps as the run counts them."""

    def train(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*GAUDI3, "train", "--out", str(tmp_path), *args, *TINY_RUN],
            capture_output=True,
            text=True,
            timeout=180,
        )

    first = train("--nproc-per-node", "2", "--train.max_steps", "3", "--profile", "0:2")
    assert first.returncode == 0, first.stderr[-3000:]
    stderr = " ".join(first.stderr.split())
    # No step before step 0 warms the profiler up: one line of ours says so, not torch's warning with our path.
    assert "step 0 is this fit's first, so no step before it warms the profiler up" in stderr
    assert "Profiler won't be using warmup" not in first.stderr
    # Every rank writes a trace: the note names them all, not rank 0's alone.
    glob = tmp_path / "profile" / "trace-rank*-steps0-2.json"
    assert (
        f"profile: {glob} (a Chrome trace per rank), {tmp_path / 'profile' / 'summary-steps0-2.txt'}"
        in stderr
    )
    second = train("--train.max_steps", "6", "--profile", "4:5")  # resumes from the first run's step 3
    assert second.returncode == 0, second.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["window_steps"]) for r in records if "window_steps" in r] == [(3, 3), (6, 3)]
    profile = tmp_path / "profile"
    assert sorted(p.name for p in profile.iterdir()) == [
        "summary-steps0-2.txt",
        "summary-steps4-5.txt",
        "trace-rank0-steps0-2.json",
        "trace-rank0-steps4-5.json",
        "trace-rank1-steps0-2.json",
    ]
    assert _profiled_steps(json.loads((profile / "trace-rank0-steps0-2.json").read_text())) == [0, 1]
    # ProfilerStep#N is the global step, as --profile counts it, not a count from the resume.
    assert _profiled_steps(json.loads((profile / "trace-rank0-steps4-5.json").read_text())) == [4]


def test_a_run_stopped_inside_the_window_writes_the_steps_that_finished(tmp_path: Path) -> None:
    """A budget of almost nothing stops the run after its first step, inside the 0..3 window: the outputs hold step
    0, not also the step torch opened after it and closed at the stop (which no step ran in)."""
    budget = ["--cost.price_usd_per_hour", "1", "--cost.budget_usd", "1e-9"]
    args = ["train", "--out", str(tmp_path), "--train.max_steps", "6", "--profile", "0:4", *budget, *TINY_RUN]
    result = subprocess.run([*GAUDI3, *args], capture_output=True, text=True, timeout=180)
    # 3: the budget's exit code (docs/reference/exit_codes.md)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "training stopped inside the window: they hold step 0 of 0..3" in " ".join(result.stderr.split())
    profile = tmp_path / "profile"
    assert _profiled_steps(json.loads((profile / "trace-rank0-steps0-4.json").read_text())) == [0]
    summary = (profile / "summary-steps0-4.txt").read_text().splitlines()
    step_row = next(line for line in summary if "ProfilerStep*" in line)
    assert step_row.split()[-1] == "1"  # the row's "# of Calls": one step


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--profile", "10:20"], "train.profile_start_step: steps 10..19 go past the last step, 11"),
        (["--profile", "7"], "--profile: expected START:END"),
        (["--train.profile_start_step", "-1"], "train.profile_start_step: must be >= 0, got -1"),
        # click leaves an optional value that starts with '-' as a stray argument; the line still names --profile
        (["--profile", "-1:2"], "--profile: expected START:END optimizer steps with 0 <= START < END"),
        (["--profile=-1:2"], "--profile: expected START:END optimizer steps with 0 <= START < END"),
        # the END typed, not the train.profile_num_steps made of it
        (
            ["--profile", "2:99999999999999999999"],
            "--profile: must fit in 64 bits (at most 9,223,372,036,854,775,807), got 99999999999999999999",
        ),
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
