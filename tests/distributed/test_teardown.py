"""Leaving the process group joins gloo's worker threads unless the caller still holds a group, and says so."""

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
