"""A NaN on one rank of a real 2-rank run (torchrun, gloo): the update is dropped on both ranks, and the run ends
bitwise where a run that never loads that batch ends — under DDP and under FSDP."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gaudi3_scale.checkpoint.reader import read_checkpoint
from gaudi3_scale.train.report import read_metrics

pytestmark = pytest.mark.distributed

COMMON = ["--no-progress", "--sample-tokens", "0", "--train.max_steps", "5", "--train.log_every_steps", "1",
          "--train.val_every_steps", "0", "--train.global_batch_size", "8", "--train.micro_batch_size", "2",
          "--parallel.nproc_per_node", "2"]  # fmt: skip


def _train(out: Path, strategy: str, *args: str, faults: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GAUDI3_INJECT_FAULTS": faults}
    command = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), *COMMON,
               "--parallel.strategy", strategy, *args]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(sorted(glob.glob(str(out / "checkpoints" / "step-*")))[-1])["state_dict"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_nan_on_rank_1_drops_the_step_on_both_ranks(tmp_path: Path, strategy: str) -> None:
    nan, skipped = tmp_path / "nan", tmp_path / "skipped"
    proc = _train(nan, strategy, faults="nan:rank=1:step=2")
    assert "health: step 2: non-finite loss or gradient norm on" in proc.stderr
    _train(skipped, strategy, "--health.skip_batches", "[2]")
    a, b = _weights(nan), _weights(skipped)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    events = [r for r in read_metrics(nan / "metrics.jsonl") if "health_event" in r]
    assert {(e["step"], e["health_event"], e["data_step"]) for e in events} == {(2, "nonfinite", 2)}
