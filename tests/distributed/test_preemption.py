"""SIGTERM / SIGUSR1 → the ranks agree, finish the step, commit a checkpoint, exit 128 + signal; the rerun resumes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from conftest import CliResult
from gaudi3_scale.checkpoint.manifest import read_manifest, verify_checkpoint

pytestmark = pytest.mark.distributed

GAUDI3 = [sys.executable, "-m", "gaudi3_scale.cli"]
ARGS = ["train", "--sample-tokens", "0", "--no-progress", "--train.val_every_steps", "0", "--train.log_every_steps",
        "1", "--checkpoint.every_steps", "0", "--train.global_batch_size", "8", "--optim.warmup_steps", "2"]  # fmt: skip


def _start(out: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [*GAUDI3, *ARGS, "--out", str(out), "--train.max_steps", "100000", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(proc: subprocess.Popen[str], out: Path, steps: int) -> None:
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 180
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)


def _worker(launcher: subprocess.Popen[str], local_rank: int) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if "gaudi3_scale.train" in " ".join(child.cmdline()) and child.environ().get("LOCAL_RANK") == str(
                local_rank
            ):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_one_process_saves_and_exits_restartable(sig: signal.Signals, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _start(out)
    _wait_for_steps(proc, out, 3)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_signal"] == sig.name and summary["interrupted"]
    assert 0 < summary["signal_to_checkpoint_s"] < 30
    assert f"stopped by {sig.name} after step {summary['steps']}" in stderr
    ckpt = Path(summary["checkpoint"])
    assert ckpt.name == f"step-{summary['steps']:08d}" and verify_checkpoint(ckpt) == []


def _stopped_by_sigterm(launcher: subprocess.Popen[str], out: Path, *, stopped_by: str = "SIGTERM") -> int:
    """Both ranks stopped after the same step, committed a checkpoint, and the launcher exited 143: that step.
    `stopped_by`: how rank 0's line names the stop (a signal that reached another rank only names that rank)."""
    _, stderr = launcher.communicate(timeout=180)
    assert launcher.returncode == 143, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert f"stopped by {stopped_by} after step {summary['steps']}; checkpoint committed" in stderr, stderr[
        -3000:
    ]
    assert "Traceback" not in stderr.split("stopped by SIGTERM")[-1]  # the launcher exits quietly, 143
    assert summary["stop_signal"] == "SIGTERM" and summary["signal_to_checkpoint_s"] < 30
    ckpt = Path(summary["checkpoint"])
    manifest = read_manifest(ckpt)
    assert manifest is not None and manifest["world_size"] == 2 and manifest["step"] == summary["steps"]
    assert (out / "checkpoints" / "latest").read_text().strip() == ckpt.name
    return int(summary["steps"])


def _train_steps(out: Path) -> list[int]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "train_loss" in r]


def test_sigterm_to_the_launcher_stops_both_ranks_after_the_same_step_and_resumes(tmp_path: Path) -> None:
    """SIGTERM to the launcher (as Kubernetes sends it to PID 1), under FSDP; the rerun resumes and finishes."""
    out = tmp_path / "run"
    launcher = _start(out, "--nproc-per-node", "2", "--parallel.strategy", "fsdp")
    _wait_for_steps(launcher, out, 3)
    launcher.send_signal(signal.SIGTERM)
    stopped_at = _stopped_by_sigterm(launcher, out)
    resumed = subprocess.run(
        [*GAUDI3, *ARGS, "--out", str(out), "--train.max_steps", str(stopped_at + 2), "--nproc-per-node", "2",
         "--parallel.strategy", "fsdp"], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _train_steps(out)[-2:] == [stopped_at + 1, stopped_at + 2]


def _logged_lines(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def test_sigterm_to_rank_1_then_sigusr1_and_ctrl_c_to_the_launcher_reach_both_ranks(tmp_path: Path) -> None:
    """SIGTERM to one rank only (rank 0 never sees it): both stop after the same step, exit 143. Then the same
    directory's reruns, each resuming the one before (the first right after the SIGTERM step): torch's agent
    passed on SIGTERM only, so SIGUSR1 killed the launcher and the ranks trained on, and Ctrl-C exited 130. Now
    each reaches both ranks, which save together; the launcher exits 138, then 0 (Ctrl-C). One chain of runs, as
    the three stops are each a 2-rank launch (the slow part of the suite on 2 cores); 2 ranks default to DDP."""
    out = tmp_path / "run"
    launcher = _start(out, "--nproc-per-node", "2")
    _wait_for_steps(launcher, out, 3)
    _worker(launcher, 1).send_signal(signal.SIGTERM)
    stopped_at = _stopped_by_sigterm(launcher, out, stopped_by="SIGTERM to rank 1")
    for sig, exit_code in ((signal.SIGUSR1, 138), (signal.SIGINT, 0)):  # each run resumes the one before
        before = len(_train_steps(out))
        launcher = _start(out, "--nproc-per-node", "2")
        _wait_for_steps(launcher, out, _logged_lines(out) + 2)
        launcher.send_signal(sig)
        _, stderr = launcher.communicate(timeout=180)
        assert launcher.returncode == exit_code, stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["stop_signal"] == sig.name and summary["interrupted"]
        manifest = read_manifest(Path(summary["checkpoint"]))
        assert manifest is not None and manifest["world_size"] == 2 and manifest["step"] == summary["steps"]
        steps = _train_steps(out)[before:]  # this run's steps: from the one after the last stop, none skipped
        assert steps == list(range(stopped_at + 1, summary["steps"] + 1)), steps
        stopped_at = summary["steps"]


def test_one_run_per_directory_and_ranks_stop_with_their_launcher(
    tmp_path: Path, gaudi3_cli: Callable[..., CliResult]
) -> None:
    """A second run in the same --out is refused while the first runs; `kill -9` of the first's launcher stops its
    ranks (they save on the way out) instead of leaving them training beside a rerun."""
    from gaudi3_scale.train.run_lock import run_directory_lock

    out = tmp_path / "run"
    launcher = _start(out, "--nproc-per-node", "2")
    _wait_for_steps(launcher, out, 3)
    code, _, stderr = gaudi3_cli(*ARGS, "--out", str(out), "--nproc-per-node", "2")  # the same command again
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert f"run directory '{out}' is in use by another training run (pid {launcher.pid})" in stderr
    launcher.kill()
    # The pipes close once every process holding them is gone: the launcher, then its ranks.
    _, stderr = launcher.communicate(timeout=120)
    assert "SIGTERM: saving a checkpoint after this step" in stderr
    with run_directory_lock(out):  # free again: no stale lock
        pass
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "train_loss" in r]
    assert steps == list(range(1, steps[-1] + 1)), steps  # every step once, none after the ranks stopped
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert verify_checkpoint(latest) == [] and latest.name == f"step-{steps[-1]:08d}"
