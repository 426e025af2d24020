"""Straggler detection in a real 2-rank run (torchrun, gloo), DDP and a pipeline of 2 stages: rank 1 slowed by a
sleep before each of its forwards is named within `health.straggler_windows` (3) logging windows of the slowdown —
in the window records, the one warning line, Prometheus-ready per-rank compute and summary.json — and an unslowed
run of 200 steps names nobody."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gaudi3_scale.train.report import read_metrics

pytestmark = pytest.mark.distributed

LOG_EVERY = 5
TINY = ["--no-progress", "--sample-tokens", "0", "--train.val_every_steps", "0", "--train.global_batch_size", "4",
        "--train.micro_batch_size", "2", "--parallel.nproc_per_node", "2", "--model.num_layers", "1",
        "--train.threads", "1", "--checkpoint.enabled", "false"]  # fmt: skip


def _train(out: Path, *args: str, faults: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GAUDI3_INJECT_FAULTS": faults}
    command = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), *TINY, *args]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _windows(out: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "compute_s_per_rank" in r]


# DDP; and PP 2 (1F1B, a layer a stage), where a step's time holds every stage's waits for the others, so a rank's
# own compute is the host time of its stage's forwards (distributed.pipeline.Pipeline.forward_s)
LAYOUTS = {
    "ddp": [],
    "pp": ["--model.name", "llama-tiny", "--model.num_layers", "2", "--parallel.pp_size", "2"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rank_slowed_by_a_sleep_is_named_within_3_windows(tmp_path: Path, layout: str) -> None:
    # rank 1 sleeps 50 ms before each forward from data step 10 on: the windows ending at 15, 20, 25
    onset = 10
    proc = _train(tmp_path / "slow", "--train.max_steps", "40", "--train.log_every_steps", str(LOG_EVERY),
                  *LAYOUTS[layout], faults=f"sleep:rank=1:step={onset}:seconds=0.05")  # fmt: skip
    windows = _windows(tmp_path / "slow")
    assert [w["step"] for w in windows] == list(range(5, 41, 5))
    assert all(len(w["compute_s_per_rank"]) == 2 for w in windows)
    assert all(
        w["compute_s_per_rank"][1] >= 0.05 for w in windows if w["step"] > onset
    )  # the sleep is counted
    # rank 0's own compute does not hold its waits for rank 1 (under the pipeline, for rank 1's activations)
    assert all(w["compute_s_per_rank"][0] < 0.05 for w in windows), [w["compute_s_per_rank"] for w in windows]
    named = [w for w in windows if w.get("stragglers")]
    first = named[0]["step"]
    detection_windows = (first - onset) // LOG_EVERY
    print(f"straggler named at step {first}: {detection_windows} windows after the slowdown")
    assert detection_windows <= 3
    assert all(w.get("stragglers") == [1] for w in windows if w["step"] >= first)  # named until the end
    assert not any(w.get("stragglers") for w in windows if w["step"] <= onset)
    lines = [line for line in proc.stderr.splitlines() if "is a straggler" in line]
    assert len(lines) == 1, proc.stderr[-3000:]  # one line per episode
    assert "health: rank 1 is a straggler: its own compute per step is" in lines[0]
    assert f"for 3 windows (step {first})" in lines[0]
    summary = json.loads((tmp_path / "slow" / "summary.json").read_text())
    (episode,) = summary["health"]["stragglers"]
    assert episode["rank"] == 1 and episode["step"] == first and episode["ratio"] > 1.2


def test_an_unslowed_run_of_200_steps_names_nobody(tmp_path: Path) -> None:
    proc = _train(tmp_path / "even", "--train.max_steps", "200", "--train.log_every_steps", "10")
    windows = _windows(tmp_path / "even")
    assert len(windows) == 20 and all(len(w["compute_s_per_rank"]) == 2 for w in windows)
    assert all(0 < s < 1 for w in windows for s in w["compute_s_per_rank"])
    assert not [w["step"] for w in windows if w.get("stragglers")]
    assert "is a straggler" not in proc.stderr
    assert json.loads((tmp_path / "even" / "summary.json").read_text())["health"]["stragglers"] == []
