"""The hang watchdog in a 2-rank gloo DDP run: rank 1 stopped with SIGSTOP mid-training is named by rank 0 within
its step timeout + 5 s, both ranks' stacks are written (rank 1's by py-spy, which reads a stopped process), rank 1
is killed rather than left to torch's 30 s SIGTERM grace, the run exits restartable, and `gaudi3 health` names
rank 1. Under `--max-restarts 1` the run restarts from its last checkpoint and ends with the weights of an
uninterrupted run, bitwise."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gaudi3_scale.health.heartbeat import read_heartbeat
from gaudi3_scale.health.report import read_health
from gaudi3_scale.health.watchdog import HANG_EXIT_CODE
from same_weights import assert_same_training_state

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GAUDI3 = [sys.executable, "-m", "gaudi3_scale.cli"]
STEP_TIMEOUT_S = 10.0
ARGS = ["train", "--sample-tokens", "0", "--no-progress", "--train.val_every_steps", "0",
        "--train.log_every_steps", "1", "--train.max_steps", "40", "--checkpoint.every_steps", "10",
        "--train.global_batch_size", "8", "--train.micro_batch_size", "2", "--optim.warmup_steps", "2",
        "--nproc-per-node", "2", "--parallel.strategy", "ddp",
        "--health.step_timeout_s", str(STEP_TIMEOUT_S)]  # fmt: skip
FINAL = "checkpoints/step-00000040"


def _steps_logged(out: Path) -> list[int]:
    metrics = out / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return [r["step"] for r in records if "train_loss" in r]


def _stop_rank_1(launcher: subprocess.Popen[str], out: Path) -> tuple[int, float]:
    """SIGSTOP rank 1 once a checkpoint is committed and 14 steps are logged; (its pid, when)."""
    heartbeat, deadline = out / "health" / "heartbeat-rank1.json", time.monotonic() + 180
    while (beat := read_heartbeat(heartbeat)) is None:  # written when its watchdog starts, before training
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.05)
    while not (out / "checkpoints" / "latest").is_file() or max(_steps_logged(out), default=0) < 14:
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.02)
    psutil.Process(beat.pid).send_signal(signal.SIGSTOP)
    return beat.pid, time.time()


def _kill_if_left(pid: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):  # torch's agent killed it already
        psutil.Process(pid).kill()


def test_a_stopped_rank_is_named_its_stacks_dumped_and_the_run_exits_restartable(tmp_path: Path) -> None:
    out = tmp_path / "run"
    launcher = subprocess.Popen([*GAUDI3, *ARGS, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
    pid, stopped_at = _stop_rank_1(launcher, out)
    try:
        _, stderr = launcher.communicate(timeout=180)
        ended_at = time.time()
    finally:
        _kill_if_left(pid)
    assert launcher.returncode == HANG_EXIT_CODE, stderr[-3000:]
    [line] = [line for line in stderr.splitlines() if line.startswith("gaudi3: hang:")]
    assert line.startswith("gaudi3: hang: rank 1 silent for up to ") and " in step at step " in line
    # its figures are its stale file's, which the line says: it may have stepped on after writing it
    assert " or a later one (" in line and "; figures from its heartbeat file, " in line

    hang = json.loads((out / "health" / "hang-rank0.json").read_text())
    [silent] = hang["silent"]
    assert (silent["rank"], silent["pid"], silent["section"]) == (1, pid, "step")
    latency_s = hang["detected_unix_s"] - stopped_at
    print(f"hang detected {latency_s:.1f} s after SIGSTOP (step timeout {STEP_TIMEOUT_S:g} s)")
    assert STEP_TIMEOUT_S - 1 < latency_s <= STEP_TIMEOUT_S + 5
    # Rank 0 killed the stopped rank 1 before exiting: torch's agent would have sent it SIGTERM, which a stopped
    # process never acts on, and killed it only after its 30 s grace.
    assert ended_at - hang["detected_unix_s"] < 20, ended_at - hang["detected_unix_s"]

    report = read_health(out)
    dumps = {(r.rank, d.path.name): d for r in report.ranks for d in r.dumps}
    assert dumps[(0, "stacks-rank0.txt")].frames, "rank 0's own stacks (faulthandler)"
    assert dumps[(1, "py-spy-rank1.txt")].frames, "rank 1's stacks, read by py-spy while it is stopped"
    assert "fit_loop" in (out / "health" / "py-spy-rank1.txt").read_text()  # inside Lightning's training loop
    shown = subprocess.run([*GAUDI3, "health", str(out)], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert (
        shown.stdout.splitlines()[1].startswith("hang found by rank 0 at ")
        and "rank 1 silent for" in shown.stdout
    )


def test_with_max_restarts_the_hung_run_restarts_and_ends_bitwise_identical(tmp_path: Path) -> None:
    reference, hung = tmp_path / "reference", tmp_path / "hung"
    proc = subprocess.run([*GAUDI3, *ARGS, "--out", str(reference)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]

    launcher = subprocess.Popen([*GAUDI3, *ARGS, "--out", str(hung), "--max-restarts", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    pid, _ = _stop_rank_1(launcher, hung)
    try:
        _, stderr = launcher.communicate(timeout=300)
    finally:
        _kill_if_left(pid)
    assert launcher.returncode == 0, stderr[-3000:]
    assert "gaudi3: hang: rank 1 silent for " in stderr

    steps = _steps_logged(hung)
    restarted_at = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    hang = json.loads((hung / "health" / "hang-rank0.json").read_text())
    resumed_from = steps[restarted_at] - 1  # the newest committed checkpoint before the hang
    assert resumed_from % 10 == 0 and 10 <= resumed_from <= hang["detected_by_step"], (steps, hang)
    assert steps[-1] == 40
    assert_same_training_state(reference / FINAL, hung / FINAL)
