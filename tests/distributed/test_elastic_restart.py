"""Elastic restart: SIGKILL one of 2 ranks mid-run under `--max-restarts 1`; the launcher restarts both, they
resume from the newest valid checkpoint, and the final weights are bitwise those of an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from same_weights import assert_same_training_state

pytestmark = pytest.mark.distributed

GAUDI3 = [sys.executable, "-m", "gaudi3_scale.cli"]
ARGS = ["train", "--sample-tokens", "0", "--no-progress", "--train.val_every_steps", "0",
        "--train.log_every_steps", "1", "--train.max_steps", "40", "--checkpoint.every_steps", "10",
        "--train.global_batch_size", "8", "--train.micro_batch_size", "2", "--optim.warmup_steps", "2",
        "--nproc-per-node", "2", "--parallel.strategy", "ddp"]  # fmt: skip
FINAL = "checkpoints/step-00000040"


def _steps_logged(out: Path) -> list[int]:
    metrics = out / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return [r["step"] for r in records if "train_loss" in r]  # not the validation after the last step


def test_sigkill_of_one_rank_restarts_and_ends_bitwise_identical(tmp_path: Path) -> None:
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    proc = subprocess.run([*GAUDI3, *ARGS, "--out", str(reference)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]

    launcher = subprocess.Popen([*GAUDI3, *ARGS, "--out", str(killed), "--max-restarts", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 180
    while not (killed / "checkpoints" / "latest").is_file() or max(_steps_logged(killed), default=0) < 14:
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.05)
    victims = [p for p in psutil.Process(launcher.pid).children(recursive=True)
               if "gaudi3_scale.train" in " ".join(p.cmdline()) and p.environ().get("LOCAL_RANK") == "1"]  # fmt: skip
    assert len(victims) == 1
    victims[0].send_signal(signal.SIGKILL)  # no handler, no checkpoint: the process is just gone
    _, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, stderr[-3000:]

    steps = _steps_logged(killed)
    restarted_at = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[restarted_at] == 11  # the restart resumed from step 10's checkpoint, the newest valid one
    assert steps[-1] == 40
    assert_same_training_state(reference / FINAL, killed / FINAL)
