"""The step guard in real `gaudi3 train` runs (a fault injected through the test-only GAUDI3_INJECT_FAULTS): a
non-finite step is dropped and the run ends bitwise where a run that never loads that batch ends; a resume across
the drop stays bitwise; a loss spike is reported, and dropped under the skip policy."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from gaudi3_scale.checkpoint.reader import read_checkpoint
from gaudi3_scale.train.report import read_metrics

COMMON = ["--no-progress", "--train.log_every_steps", "1", "--train.val_every_steps", "0",
          "--checkpoint.every_steps", "2", "--checkpoint.keep_last", "5"]  # fmt: skip


def _train(out: Path, *args: str, faults: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GAUDI3_INJECT_FAULTS": faults}
    proc = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--sample-tokens", "0", *COMMON, *args],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _final(out: Path) -> dict[str, Any]:
    return read_checkpoint(sorted(glob.glob(str(out / "checkpoints" / "step-*")))[-1])


def _same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["state_dict"].keys() == b["state_dict"].keys() and all(
        torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"]
    )


def test_a_nan_step_is_dropped_everywhere_and_ends_where_skipping_its_batch_ends(tmp_path: Path) -> None:
    nan, skipped = tmp_path / "nan", tmp_path / "skipped"
    proc = _train(nan, "--train.max_steps", "6", faults="nan:step=3")
    assert "health: step 3: non-finite loss or gradient norm on 1 of 1 rank(s); update dropped" in proc.stderr
    _train(skipped, "--train.max_steps", "6", "--health.skip_batches", "[3]")
    a, b = _final(nan), _final(skipped)
    assert a["global_step"] == b["global_step"] == 6
    assert _same_weights(a, b)
    assert a["TokenDataModule"]["samples_consumed"] == b["TokenDataModule"]["samples_consumed"]
    events = [r for r in read_metrics(nan / "metrics.jsonl") if "health_event" in r]
    assert [(e["step"], e["health_event"], e["health_action"], e["data_step"]) for e in events] == [
        (3, "nonfinite", "skip", 3)
    ]
    train_steps = [r["step"] for r in read_metrics(nan / "metrics.jsonl") if r.get("train_loss") is not None]
    assert train_steps == [1, 2, 3, 4, 5, 6]  # one record per update; the dropped step made none
    health = json.loads((nan / "summary.json").read_text())["health"]
    assert (health["nonfinite"], health["dropped"], health["dropped_batches"]) == (1, 1, [3])
    assert a["gaudi3_health"]["skips"] == {"skipped": [], "dropped": [3]}


def test_a_resume_across_a_dropped_step_is_bitwise(tmp_path: Path) -> None:
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _train(whole, "--train.max_steps", "6", faults="nan:step=3")
    _train(resumed, "--train.max_steps", "4", faults="nan:step=3")  # stops after the drop, at update 4
    _train(resumed, "--train.max_steps", "6", faults="nan:step=3")  # resumes: batch 3 is not loaded again
    a, b = _final(whole), _final(resumed)
    assert _same_weights(a, b)
    assert b["gaudi3_health"]["skips"]["dropped"] == [3]


def test_a_loss_spike_is_reported_and_dropped_under_the_skip_policy(tmp_path: Path) -> None:
    warned, skipped = tmp_path / "warn", tmp_path / "skip"
    spike = [
        "--train.max_steps",
        "10",
        "--health.spike_window_steps",
        "5",
        "--health.spike_warmup_steps",
        "4",
    ]
    proc = _train(warned, *spike, faults="spike:step=7:scale=20")
    assert "health: step 7: loss" in proc.stderr and "update applied" in proc.stderr
    _train(skipped, *spike, "--health.spike_policy", "skip", faults="spike:step=7:scale=20")
    events = [r for r in read_metrics(skipped / "metrics.jsonl") if "health_event" in r]
    assert [(e["step"], e["health_event"], e["health_action"]) for e in events] == [(7, "loss_spike", "skip")]
    assert _final(skipped)["gaudi3_health"]["skips"]["dropped"] == [7]
    assert not _same_weights(_final(warned), _final(skipped))
