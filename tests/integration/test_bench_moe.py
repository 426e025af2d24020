"""benchmarks/bench_moe.py: the smallest side-by-side run records both models' steps and their ratio; a count flag
it cannot measure with (`--repeats 0`: no step timed, then a median of nothing) is one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_moe.py"
TINY = ["--layers", "1", "--dim", "32", "--heads", "2", "--experts", "2", "--top-k", "1", "--expert-ffn", "16",
        "--vocab", "32", "--batch", "1", "--seq-len", "8", "--warmup", "0", "--steps", "1"]  # fmt: skip


def test_the_smallest_run_times_both_models_and_writes_their_ratio(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--repeats", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    moe, dense = report["results"]["moe"], report["results"]["dense"]
    assert len(moe["step_s"]) == len(dense["step_s"]) == 2  # steps × repeats, alternating
    assert moe["num_experts"] == 2 and dense["num_experts"] is None and dense["ffn_dim"] == 16
    assert report["moe_over_dense_step_time"] == moe["median_step_s"] / dense["median_step_s"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["moe.json"]  # written in one piece, no temporary left


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--repeats", "0"], "--repeats: must be at least 1, got 0"),
        (["--batch", "two"], "--batch: expected a whole number, got 'two'"),
    ],
)
def test_a_bad_count_is_one_line_and_exit_2(tmp_path: Path, flags: list[str], error: str) -> None:
    out = tmp_path / "moe.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, *flags, "--out", str(out)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == f"bench_moe.py: error: argument {error}"
    assert "Traceback" not in done.stderr and not out.exists()
