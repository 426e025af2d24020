"""benchmarks/bench_process_exit.py runs a case both ways in fresh processes and records the exit, wall and CPU
seconds of each, with the machine, as JSON and a PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_process_exit.py"


def test_one_case_is_measured_both_ways_and_recorded(tmp_path: Path) -> None:
    out = tmp_path / "process_exit.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--cases", "torch", "--reps", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    [row] = result["results"]
    assert row["case"] == "torch" and result["median_of"] == 1 and result["machine"]["cpu_count"]
    for key in ("plain_exit_s", "skip_exit_s", "plain_wall_s", "skip_wall_s", "plain_cpu_s", "skip_cpu_s"):
        assert 0 < row[key] < 120, (key, row)
    # a process's exit is part of its wall time, and importing torch takes CPU
    assert row["plain_exit_s"] < row["plain_wall_s"] and row["skip_exit_s"] < row["skip_wall_s"]
    assert row["exit_saved_s"] == pytest.approx(row["plain_exit_s"] - row["skip_exit_s"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[2/2] torch" in done.stdout


def test_an_unknown_case_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--cases", "numpy", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (
        done.returncode == 2
        and "--cases: unknown ['numpy']; valid: torch, lightning, gaudi3-train" in done.stderr
    )
    assert not (tmp_path / "x.json").exists()
