"""benchmarks/bench_stragglers.py slows rank 1 of a real 2-rank run and records when it is named, per window, with
the machine, as JSON and a PNG (one clear slowdown here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_stragglers.py"


def test_a_clear_straggler_is_measured_and_recorded(tmp_path: Path) -> None:
    out = tmp_path / "stragglers.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--delays", "0.05", "--steps", "30", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    (cell,) = result["cells"]
    assert [w["step"] for w in cell["windows"]] == [5, 10, 15, 20, 25, 30]
    assert cell["named_at_step"] == 25 and cell["detection_windows"] == 3 and not cell["false_positive"]
    assert all(w["rank1_over_median"] > 1.5 for w in cell["windows"] if w["step"] > 10)
    assert result["machine"]["cpu_count"] and out.with_suffix(".png").stat().st_size > 0
    assert "delay 50 ms: named after 3 windows; false positive: False" in done.stdout
