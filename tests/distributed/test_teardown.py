"""Leaving the process group joins gloo's worker threads unless something still holds a group; then the trainer
says so on every rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("teardown_worker.py")


def test_leave_counts_the_threads_of_a_group_still_held(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
         str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # gloo runs two worker threads per group: the held one's stay (the world's and the mesh's go), then go too
    assert [(tmp_path / f"threads-{rank}").read_text() for rank in (0, 1)] == ["2 0", "2 0"]


def test_a_fit_whose_caller_holds_a_group_says_so_on_every_rank(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(Path(__file__).with_name("held_group_fit.py")), f"--out_dir={tmp_path}", "--train.max_steps=2",
         "--train.val_every_steps=0", "--train.global_batch_size=4", "--train.micro_batch_size=2",
         "--checkpoint.enabled=false", "--parallel.nproc_per_node=2", "--parallel.strategy=ddp"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):  # the run's own groups are gone; the callback's (two threads) is not
        assert f"rank {rank}: 2 gloo worker threads are still up" in proc.stderr, proc.stderr[-3000:]
