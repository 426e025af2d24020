"""benchmarks/bench_pipeline.py refuses a count flag it cannot measure with one line and exit 2, before any launch.

An odd `--micro-batches` cannot be split over FSDP 2's two data-parallel ranks: each ran m // 2 micro-batches while
tokens/s counted m, overstating FSDP's tokens/s (m = 5: by 25 %). Zero crashed inside torch's pipeline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_pipeline.py"


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--micro-batches", "5"], "--micro-batches: must be even (FSDP 2 splits them over 2 ranks), got 5"),
        (["--micro-batches", "0"], "--micro-batches: must be at least 1, got 0"),
        (["--steps", "0"], "--steps: must be at least 1, got 0"),
        (["--warmup", "-1"], "--warmup: must be at least 0, got -1"),
        (["--micro", "x"], "--micro: expected a whole number, got 'x'"),
    ],
)
def test_a_bad_count_is_one_line_and_exit_2(tmp_path: Path, flags: list[str], error: str) -> None:
    out = tmp_path / "pipeline.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *flags, "--out", str(out)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == f"bench_pipeline.py: error: argument {error}"
    assert "Traceback" not in done.stderr and not out.exists()
