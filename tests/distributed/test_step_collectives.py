"""What a training step asks of the other ranks, on 2 real ranks (gloo): the stop flags' asynchronous all-reduce,
and at a logging step the loss's all-reduce and the per-rank gather; no barrier and no broadcast. On an accelerator
either would hold the host until the device ran all queued work, every step (Lightning's SIGTERM flag broadcast) or
every logging window (the barrier Lightning puts before a reduce)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("step_collectives_fit.py")
STEPS = 4


def test_a_step_issues_no_barrier_and_no_broadcast(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
         str(tmp_path), f"--out_dir={tmp_path / 'run'}", f"--train.max_steps={STEPS}", "--train.log_every_steps=2",
         "--train.val_every_steps=0", "--train.global_batch_size=4", "--train.micro_batch_size=2",
         "--checkpoint.enabled=false", "--parallel.nproc_per_node=2", "--parallel.strategy=ddp"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        events = json.loads((tmp_path / f"collectives-{rank}.json").read_text())
        starts = [i for i, event in enumerate(events) if event[0] == "batch_start"]
        assert [events[i][1] for i in starts] == list(range(1, STEPS + 1)), events
        # from the first step's start to just before the last one (the last step also ends the fit)
        for step, (begin, end) in enumerate(itertools.pairwise(starts), start=1):
            between = events[begin + 1 : end]
            called = sorted((name, async_op) for name, async_op in between if name != "batch_end")
            want = [("all_reduce", True)]  # GracefulInterrupt: the stop flags, read a step later
            # a logging step: the window's loss (mean over ranks), and each rank's peak memory and step time
            if step % 2 == 0:
                want = sorted([*want, ("all_gather", False), ("all_reduce", False)])
            assert called == want, (rank, step, events[begin:end])
