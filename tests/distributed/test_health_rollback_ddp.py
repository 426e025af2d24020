"""A loss spike with `health.spike_policy rollback` in a real 2-rank run (torchrun, gloo), DDP and a pipeline of 2
stages: both ranks roll back in the same process, forming their group (and the pipeline's mesh) again for the
re-fit, and the run ends bitwise where a run that never loads the skipped batches ends."""

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

COMMON = ["--no-progress", "--sample-tokens", "0", "--train.max_steps", "10", "--train.log_every_steps", "1",
          "--train.val_every_steps", "0", "--parallel.nproc_per_node", "2", "--checkpoint.every_steps", "2",
          "--health.spike_window_steps", "5", "--health.spike_warmup_steps", "4"]  # fmt: skip


def _train(out: Path, *args: str, faults: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GAUDI3_INJECT_FAULTS": faults}
    command = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), *COMMON, *args]
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(sorted(glob.glob(str(out / "checkpoints" / "step-*")))[-1])["state_dict"]


# PP 2: llama-tiny's 2 layers a stage each, 4 sequences in micro-batches of 2 (the pipeline's 2 micro-batches)
LAYOUTS = {
    "ddp": [],
    "pp": ["--model.name", "llama-tiny", "--parallel.pp_size", "2", "--train.global_batch_size", "4",
           "--train.micro_batch_size", "2"],
}  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_run_rolls_back_on_both_ranks_and_ends_where_skipping_the_batches_ends(
    tmp_path: Path, layout: str
) -> None:
    rolled, skipped = tmp_path / "rolled", tmp_path / "skipped"
    spike = "spike:step=7:scale=20"
    proc = _train(rolled, *LAYOUTS[layout], "--health.spike_policy", "rollback", "--health.rollback_skip_batches",
                  "3", faults=spike)  # fmt: skip
    assert "rolled back from step 7 to checkpoint step 6; data batches 6–8 skipped" in proc.stderr
    _train(skipped, *LAYOUTS[layout], "--health.skip_batches", "[6, 7, 8]", faults=spike)
    a, b = _weights(rolled), _weights(skipped)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    events = [r for r in read_metrics(rolled / "metrics.jsonl") if r.get("health_event") == "rollback"]
    assert [(e["from_step"], e["to_step"], e["skipped_batches"]) for e in events] == [(7, 6, [6, 8])]
