"""A NaN on one rank of a real 2-rank run (torchrun, gloo): the update is dropped on both ranks, and the run ends
bitwise where a run that never loads that batch ends — under DDP, under FSDP and under a pipeline of 2 stages, the
last two with the re-run check."""

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


@pytest.mark.parametrize("strategy", ["ddp"])  # FSDP's drop is covered above; its re-run is the same code
def test_the_rerun_check_names_the_rank_of_a_transient_fault_and_the_batch_of_a_data_one(
    tmp_path: Path, strategy: str
) -> None:
    checked, unchecked = tmp_path / "checked", tmp_path / "unchecked"
    faults = "nan:rank=1:step=1:transient=1,nan:rank=0:step=3"
    proc = _train(checked, strategy, "--health.rerun_check", "true", faults=faults)
    assert "re-run differs: hardware fault suspected, rank(s) 1 computed other losses" in proc.stderr
    _train(unchecked, strategy, faults=faults)
    events = {e["step"]: e for e in read_metrics(checked / "metrics.jsonl") if "health_event" in e}
    assert (events[1]["rerun"]["suspect"], events[1]["rerun"]["ranks"]) == ("hardware", [1])
    data = events[2]  # data step 3 is update 2's: the dropped batch 1 made none
    assert (data["data_step"], data["rerun"]["suspect"], data["rerun"]["ranks"]) == (3, "data", [])
    samples = data["rerun"]["batch"]["samples"]  # the whole global batch: 4 samples from each rank
    assert sorted(s["rank"] for s in samples) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len({(s["shard"], s["offset"]) for s in samples}) == 8
    a, b = _weights(checked), _weights(unchecked)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_under_a_pipeline_the_guard_drops_the_step_and_the_rerun_check_reruns_it_whole(
    tmp_path: Path,
) -> None:
    """PP 2 (1F1B, rank 1 holds the last stage, where the loss is computed): a transient NaN at data step 1 and a
    reproducible one at data step 3, with the re-run check and dropout. Both updates are dropped on both ranks, and
    the run ends bitwise where one that skips those two batches ends. The re-run of the first differs on both ranks
    (the loss is the pipeline's, shared by its stages); the second reproduces and names its batch, which both stages
    read."""
    checked, skipped = tmp_path / "checked", tmp_path / "skipped"
    # dropout on: the re-run draws the step's masks again (seeded by step and rank), or it could not reproduce
    pipeline = ["--model.name", "llama-tiny", "--model.dropout", "0.1", "--parallel.pp_size", "2"]
    faults = "nan:rank=1:step=1:transient=1,nan:rank=1:step=3"
    proc = _train(checked, "fsdp", *pipeline, "--health.rerun_check", "true", faults=faults)
    assert "re-run differs: hardware fault suspected, rank(s) 0, 1 computed other losses" in proc.stderr
    _train(skipped, "fsdp", *pipeline, "--health.skip_batches", "[1,3]")
    a, b = _weights(checked), _weights(skipped)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    events = {e["step"]: e for e in read_metrics(checked / "metrics.jsonl") if "health_event" in e}
    assert sorted(events) == [1, 2]
    first = events[1]
    assert (first["data_step"], first["rerun"]["suspect"], first["rerun"]["ranks"]) == (1, "hardware", [0, 1])
    data = events[2]  # data step 3 is update 2's: the dropped batch 1 made none
    assert (data["data_step"], data["rerun"]["suspect"], data["rerun"]["ranks"]) == (3, "data", [])
    samples = data["rerun"]["batch"]["samples"]
    read = {rank: [(s["shard"], s["offset"]) for s in samples if s["rank"] == rank] for rank in (0, 1)}
    assert read[0] == read[1] and len(set(read[0])) == 8  # the pipeline's 8 sequences, on both of its stages
