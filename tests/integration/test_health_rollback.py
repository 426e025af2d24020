"""`health.spike_policy rollback` in real `gaudi3 train` runs (a loss spike injected through the test-only
GAUDI3_INJECT_FAULTS, keyed by data step): the run restores the newest checkpoint at or before the spike, skips
`health.rollback_skip_batches` batches from its data step and ends bitwise where a run that never loads them ends;
a resume from the middle stays bitwise; past `health.max_rollbacks` the run stops with exit 5 (not restartable) and
one line."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gaudi3_scale.checkpoint.reader import read_checkpoint
from gaudi3_scale.train.report import read_metrics

# Spikes looked for after 4 steps of history; a checkpoint every 2 steps: a spike at data step 7 (optimizer step
# 7) rolls back to the checkpoint of step 6, whose stream resumes at data step 6, and skips batches 6, 7 and 8.
COMMON = ["--no-progress", "--sample-tokens", "0", "--train.log_every_steps", "1", "--train.val_every_steps", "0",
          "--checkpoint.every_steps", "2", "--checkpoint.keep_last", "10", "--health.spike_window_steps", "5",
          "--health.spike_warmup_steps", "4"]  # fmt: skip
ROLLBACK = ["--health.spike_policy", "rollback", "--health.rollback_skip_batches", "3"]
SPIKE = "spike:step=7:scale=20"


def _train(out: Path, *args: str, faults: str = "", exit_code: int = 0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GAUDI3_INJECT_FAULTS": faults}
    proc = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), *COMMON, *args],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert proc.returncode == exit_code, proc.stderr[-3000:]
    return proc


def _final(out: Path) -> dict[str, Any]:
    return read_checkpoint(sorted(glob.glob(str(out / "checkpoints" / "step-*")))[-1])


def _same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["state_dict"].keys() == b["state_dict"].keys() and all(
        torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"]
    )


def _events(out: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "health_event" in r]


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("rollback") / "run"
    return out, _train(out, "--train.max_steps", "10", *ROLLBACK, faults=SPIKE)


def test_a_rollback_restores_the_checkpoint_before_the_spike_and_ends_where_skipping_its_batches_ends(
    rolled_back: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    out, proc = rolled_back
    assert "health: step 7: loss" in proc.stderr and "rolling back" in proc.stderr
    assert (
        "health: step 7: rolled back from step 7 to checkpoint step 6; data batches 6–8 skipped"
        in proc.stderr
    )
    skipped = tmp_path / "skipped"
    _train(skipped, "--train.max_steps", "10", "--health.skip_batches", "[6, 7, 8]", faults=SPIKE)
    a, b = _final(out), _final(skipped)
    assert a["global_step"] == b["global_step"] == 10
    assert _same_weights(a, b)
    assert a["TokenDataModule"]["samples_consumed"] == b["TokenDataModule"]["samples_consumed"]
    assert a["gaudi3_health"]["skips"] == {"skipped": [6, 7, 8], "dropped": []}
    assert a["gaudi3_health"]["counts"]["rollback"] == 1 and a["gaudi3_health"]["lr_scale"] == 1.0
    events = _events(out)
    assert [(e["step"], e["health_event"], e["health_action"]) for e in events] == [
        (7, "loss_spike", "rollback"),
        (7, "rollback", "rollback"),
    ]
    assert (events[1]["from_step"], events[1]["to_step"], events[1]["skipped_batches"]) == (7, 6, [6, 8])
    health = json.loads((out / "summary.json").read_text())["health"]
    assert (health["loss_spike"], health["rollback"], health["skipped_batches"]) == (1, 1, [6, 7, 8])
    assert [e["health_event"] for e in health["events"]] == ["loss_spike", "rollback"]
    assert (out / "loss.png").stat().st_size > 0


def test_a_resume_from_the_middle_of_a_rolled_back_run_is_bitwise(
    rolled_back: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    resumed = tmp_path / "resumed"
    _train(resumed, "--train.max_steps", "9", *ROLLBACK, faults=SPIKE)  # rolls back, stops at update 9
    proc = _train(resumed, "--train.max_steps", "10", *ROLLBACK, faults=SPIKE)  # the skips come with it
    assert "rolled back" not in proc.stderr
    a, b = _final(rolled_back[0]), _final(resumed)
    assert b["global_step"] == 10
    assert _same_weights(a, b)
    assert a["gaudi3_health"] == b["gaudi3_health"]


def test_a_checkpoint_further_back_than_the_skip_still_skips_the_spiking_batch(tmp_path: Path) -> None:
    """One batch skipped from the checkpoint of step 6 would replay batch 7, which spiked: the rollback skips
    through it (6 and 7), and the run ends after one rollback instead of rolling back to step 6 until
    health.max_rollbacks stops it."""
    out = tmp_path / "short-skip"
    proc = _train(out, "--train.max_steps", "10", "--health.spike_policy", "rollback",
                  "--health.rollback_skip_batches", "1", faults=SPIKE)  # fmt: skip
    assert "rolled back from step 7 to checkpoint step 6; data batches 6–7 skipped" in proc.stderr
    assert [(e["health_event"], e.get("skipped_batches")) for e in _events(out)] == [
        ("loss_spike", None), ("rollback", [6, 7])
    ]  # fmt: skip
    final = _final(out)
    assert final["global_step"] == 10 and final["gaudi3_health"]["counts"]["rollback"] == 1


def test_a_spike_after_max_rollbacks_stops_with_a_non_restartable_exit_code_and_the_lr_stays_scaled(
    rolled_back: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    out = tmp_path / "stopped"
    # Data step 12 is optimizer step 9 after the rollback (steps 6, 7, 8 load batches 9, 10, 11).
    faults = f"{SPIKE},spike:step=12:scale=20"
    stop = [*ROLLBACK, "--health.max_rollbacks", "1", "--health.rollback_lr_scale", "0.5"]
    proc = _train(out, "--train.max_steps", "10", *stop, faults=faults, exit_code=5)
    last = proc.stderr.strip().splitlines()[-1]
    # A restart would load batch 12 on the same weights and stop again: not 143, which launchers restart.
    assert last.startswith(
        "stopped by a loss spike at step 9 (data batch 12) after health.max_rollbacks (1) rollbacks; nothing saved "
        "after it; exit 5 (not restartable"
    ), last
    assert "add it to health.skip_batches" in last
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["stop_exit_code"], summary["steps"], summary["health"]["rollback"]) == (5, 9, 1)
    assert [(e["step"], e["health_event"], e["health_action"]) for e in _events(out)] == [
        (7, "loss_spike", "rollback"),
        (7, "rollback", "rollback"),
        (9, "loss_spike", "stop"),
    ]
    # The learning rate follows the step; after the rollback it is half the unscaled run's, exactly.
    lr = {r["step"]: r["lr"] for r in read_metrics(out / "metrics.jsonl") if r.get("train_loss") is not None}
    unscaled = {r["step"]: r["lr"] for r in read_metrics(rolled_back[0] / "metrics.jsonl") if "lr" in r}
    assert [lr[s] for s in (1, 6)] == [unscaled[s] for s in (1, 6)]
    assert [lr[s] for s in (7, 8, 9)] == [unscaled[s] * 0.5 for s in (7, 8, 9)]
    assert _final(out)["gaudi3_health"]["lr_scale"] == 0.5
    # What the line says to do works: with batch 12 skipped, the same command resumes past it and finishes.
    _train(out, "--train.max_steps", "10", *stop, "--health.skip_batches", "[12]", faults=faults)
    assert _final(out)["global_step"] == 10
