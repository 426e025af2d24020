"""The step guard in real `gaudi3 train` runs (a fault injected through the test-only GAUDI3_INJECT_FAULTS): a
non-finite step is dropped and the run ends bitwise where a run that never loads that batch ends; a resume across
the drop stays bitwise; a loss spike is reported, and dropped under the skip policy."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
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
    # the dropped batch listed too, as its health line suggests, with the guard on and off: it made no update, so
    # listing it takes nothing back and moves nothing
    listed = {guard: tmp_path / f"listed-{guard}" for guard in ("true", "false")}
    for guard, out in listed.items():
        shutil.copytree(resumed, out)
        _train(
            out, "--train.max_steps", "6", "--health.skip_batches", "[3]", "--health.nonfinite_guard", guard
        )
    _train(resumed, "--train.max_steps", "6", faults="nan:step=3")  # resumes: batch 3 is not loaded again
    a, b = _final(whole), _final(resumed)
    assert _same_weights(a, b)
    assert b["gaudi3_health"]["skips"]["dropped"] == [3]
    for out in listed.values():
        c = _final(out)
        assert _same_weights(a, c), out
        assert c["TokenDataModule"]["samples_consumed"] == a["TokenDataModule"]["samples_consumed"]


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


# lr 1e30 from the first step: update 0 is applied, every loss after it is NaN, so every later update is dropped.
DIVERGED = ["--train.max_steps", "5", "--optim.lr", "1e30", "--optim.warmup_steps", "0"]


def test_a_run_whose_updates_are_all_dropped_stops_on_sigterm_with_its_checkpoint(tmp_path: Path) -> None:
    """Dropped updates leave global_step where it is; the stop agreement still runs at every step boundary, so
    SIGTERM ends the run at the next one with its checkpoint (exit 143), not never."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--sample-tokens", "0",
               *COMMON, *DIVERGED, "--health.max_dropped_in_a_row", "1000000"]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # the first dropped update: the run is in its loop of dropped steps
            seen.append(line)
            if "update dropped" in line:
                break
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, "".join(seen) + rest[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["stop_signal"], summary["steps"]) == ("SIGTERM", 1)
    saved = _final(out)  # the stop's checkpoint: step 1, its dropped batches skipped on resume
    assert saved["global_step"] == 1 and saved["gaudi3_health"]["skips"]["dropped"][0] == 1


def test_a_diverged_run_stops_after_max_dropped_in_a_row_with_exit_5_saving_nothing_new(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "GAUDI3_INJECT_FAULTS": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--sample-tokens", "0", *COMMON,
         *DIVERGED, "--checkpoint.every_steps", "1", "--health.max_dropped_in_a_row", "5"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert proc.stderr.count("update dropped") == 5
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "stopped by 5 updates in a row dropped at step 1 for non-finite losses or gradient norms "
        "(health.max_dropped_in_a_row), data batches 1–5; nothing saved after it; exit 5 (not restartable"
    ), last
    assert "lower optim.lr" in last
    # the checkpoint of step 1 (after the one applied update) is the newest: no final one over it
    assert [Path(p).name for p in sorted(glob.glob(str(out / "checkpoints" / "step-*")))] == ["step-00000001"]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["stop_exit_code"], summary["health"]["dropped"]) == (5, 5)


def test_a_skip_listed_below_the_resume_point_is_refused_and_the_position_stays_exact(tmp_path: Path) -> None:
    """A resume counts the stream from the checkpoint's data step: a listed batch below it that the checkpoint's run
    trained on is refused (one line, nothing written), and one its run skipped but the list no longer names (the
    guard off, so no record of it but the position) moves nothing: no batch is lost or read twice."""
    out = tmp_path / "run"
    off = ["--health.nonfinite_guard", "false", "--health.spike_policy", "off", "--model.num_layers", "1",
           "--model.dim", "64", "--train.threads", "1"]  # fmt: skip
    _train(out, "--train.max_steps", "4", "--health.skip_batches", "[1]", *off)  # checkpoint at data step 5
    at_four = _final(out)
    batch = at_four["TokenDataModule"]["global_batch_size"]
    assert at_four["TokenDataModule"]["samples_consumed"] == 5 * batch
    env, config = {**os.environ, "GAUDI3_INJECT_FAULTS": ""}, (out / "config.yaml").read_text()
    refused = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--sample-tokens", "0", *COMMON,
         "--train.max_steps", "6", "--health.skip_batches", "[1, 2]", *off],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-3000:]
    assert lines[0].startswith(
        "gaudi3: error: health.skip_batches: batch 2 was trained on before data step 5"
    )
    assert _final(out)["global_step"] == 4 and (out / "config.yaml").read_text() == config
    _train(out, "--train.max_steps", "6", *off)  # the list without batch 1: the stream still passed it
    assert _final(out)["TokenDataModule"]["samples_consumed"] == 7 * batch
