"""benchmarks/bench_health.py runs `gaudi3 train` with the health checks on and off in alternated pairs and records
each pair's step times and ratio, with the machine, as JSON and a PNG (one short pair on one rank here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_health.py"


def test_one_pair_is_measured_and_recorded(tmp_path: Path) -> None:
    out = tmp_path / "health.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "40", "--pairs", "1", "--ranks", "1", "--interleaved-steps", "60",
         "--interleaved-ranks", "1", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    (cell,) = result["cells"]
    (pair,) = cell["pairs"]
    assert cell["ranks"] == 1 and pair["on_step_time_s"] > 0 and pair["off_step_time_s"] > 0
    assert pair["ratio"] == pytest.approx(pair["on_step_time_s"] / pair["off_step_time_s"])
    assert cell["median_ratio"] == pair["ratio"] and result["machine"]["cpu_count"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert "1 rank(s): health on / off = " in done.stdout
    assert [cell["ranks"] for cell in result["interleaved"]] == [1, 2]  # the 2-rank one under torchrun
    for interleaved in result["interleaved"]:
        assert interleaved["guarded_steps"] + interleaved["unguarded_steps"] == 60 - 30
        assert abs(interleaved["guarded_steps"] - interleaved["unguarded_steps"]) <= 1
        assert interleaved["median_ratio"] == pytest.approx(
            interleaved["median_guarded_step_s"] / interleaved["median_unguarded_step_s"]
        )
    assert "interleaved, 2 rank(s): guarded / unguarded step = " in done.stdout
