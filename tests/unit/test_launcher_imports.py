"""`gaudi3 train --nproc-per-node N`'s launcher checks the run and starts the ranks without importing Lightning:
its ranks import it themselves, and the launcher's own import of Lightning (with torchmetrics and matplotlib, which
Lightning pulls in) is seconds of CPU before any rank starts. Checked in a fresh interpreter, on the modules and the
checks the launcher runs, with a tracker, a budget and a checkpoint to resume configured, so each check does work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from gaudi3_scale.checkpoint.manifest import write_manifest

SNIPPET = """
import sys
from pathlib import Path

from gaudi3_scale.cli import main, train_cmd  # noqa: F401  (what `gaudi3 train` imports)
from gaudi3_scale.distributed.launch import launch  # noqa: F401
from gaudi3_scale.train.config import resolve_config
from gaudi3_scale.train.preflight import check_run_inputs, resume_point
from gaudi3_scale.train.run_lock import run_directory_lock

cfg = resolve_config(None, ["--monitor.loggers", "csv", "--cost.budget_usd", "100", "--cost.instance", "aws/p5.48xlarge/us-east-1",
                            "--parallel.nproc_per_node", "2"], out_dir=sys.argv[1])
check_run_inputs(cfg)
with run_directory_lock(cfg.output_dir, node_rank=0):
    resumed = resume_point(cfg)
assert resumed is not None and "step-00000002" in resumed.parts, resumed
heavy = sorted(m for m in ("lightning", "pytorch_lightning", "torchmetrics", "matplotlib") if m in sys.modules)
assert not heavy, f"the launcher imported {heavy}"
print("ok")
"""


def test_the_launchers_checks_do_not_import_lightning(tmp_path: Path) -> None:
    out = tmp_path / "run"
    saved = out / "checkpoints" / "step-00000002"
    saved.mkdir(parents=True)
    torch.save({"state_dict": {"w": torch.zeros(2)}, "global_step": 2}, saved / "state.ckpt")
    write_manifest(saved, {"step": 2, "cost_usd": 1.0})
    done = subprocess.run(
        [sys.executable, "-c", SNIPPET, str(out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
