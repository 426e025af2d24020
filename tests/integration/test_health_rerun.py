"""The re-run check (`health.rerun_check`) in real `gaudi3 train` runs, with faults injected through the test-only
GAUDI3_INJECT_FAULTS: a fault in the data reproduces and the event names its batch (shard and offsets); a transient
fault (injected only the first time its step runs) does not, and the event names the rank; a re-run leaves the
run's weights bitwise what they are without the check."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from gaudi3_scale.checkpoint.reader import read_checkpoint
from gaudi3_scale.train.report import read_metrics

COMMON = ["--no-progress", "--sample-tokens", "0", "--train.log_every_steps", "1", "--train.val_every_steps", "0",
          "--train.max_steps", "8", "--train.global_batch_size", "8", "--train.micro_batch_size", "4"]  # fmt: skip
SPIKE = ["--health.spike_window_steps", "4", "--health.spike_warmup_steps", "3"]


def _train(out: Path, *args: str, faults: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GAUDI3_INJECT_FAULTS": faults}
    proc = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), *COMMON, *args],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _events(out: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "health_event" in r]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(sorted(glob.glob(str(out / "checkpoints" / "step-*")))[-1])["state_dict"]


def test_a_fault_in_the_data_reproduces_and_names_its_batch_a_transient_one_names_the_rank(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    proc = _train(out, "--health.rerun_check", "true", faults="nan:step=2,nan:step=5:transient=1")
    data, hardware = _events(out)
    assert (data["step"], data["rerun"]["reproduced"], data["rerun"]["suspect"]) == (2, True, "data")
    batch = data["rerun"]["batch"]
    assert batch["data_step"] == 2 and batch["samples_total"] == 8 == len(batch["samples"])
    offsets = [s["offset"] for s in batch["samples"]]
    assert len(set(offsets)) == 8 and all(s["shard"] == 0 and s["rank"] == 0 for s in batch["samples"])
    assert "re-run reproduces it: a data or optimisation problem, data batch 2" in proc.stderr
    # the batch of data step 5 is the 5th update's (step 4): the dropped batch 2 made none
    assert (hardware["step"], hardware["data_step"]) == (4, 5)
    assert (hardware["rerun"]["suspect"], hardware["rerun"]["ranks"]) == ("hardware", [0])
    assert "re-run differs: hardware fault suspected, rank(s) 0 computed other losses" in proc.stderr
    shown = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "health", str(out)],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert (
        "step 2: nonfinite (skip): non-finite loss or gradient norm on 1 of 1 rank(s); re-run reproduces"
        in shown
    )
    assert "step 4: nonfinite (skip)" in shown and "hardware fault suspected, rank(s) 0" in shown
    # another data step is another batch: the offsets named are the batch's, not a constant
    other = _train(tmp_path / "other", "--health.rerun_check", "true", faults="nan:step=3")
    assert other.returncode == 0
    assert [s["offset"] for s in _events(tmp_path / "other")[0]["rerun"]["batch"]["samples"]] != offsets


def test_a_rerun_of_an_applied_spike_leaves_the_weights_bitwise(tmp_path: Path) -> None:
    checked, unchecked = tmp_path / "checked", tmp_path / "unchecked"
    _train(checked, *SPIKE, "--health.rerun_check", "true", faults="spike:step=6:scale=30")
    _train(unchecked, *SPIKE, faults="spike:step=6:scale=30")
    (event,) = _events(checked)
    assert (event["health_event"], event["health_action"], event["rerun"]["reproduced"]) == (
        "loss_spike", "warn", True
    )  # fmt: skip
    assert "rerun" not in _events(unchecked)[0]
    a, b = _weights(checked), _weights(unchecked)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
