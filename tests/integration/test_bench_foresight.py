"""benchmarks/bench_foresight.py forecasts a case with and without a probe, runs it, and records each quantity's
error against the run's summary.json with the machine, as JSON and a PNG (one short case here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_foresight.py"


def test_one_case_is_predicted_run_and_compared(tmp_path: Path) -> None:
    out = tmp_path / "foresight.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--cases", "default-60", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    (case,) = result["cases"]
    assert case["case"] == "default-60" and case["steps"] == 60 and result["machine"]["cpu_count"]
    for mode in ("catalog", "probed"):
        for quantity, error in case[f"error_{mode}"].items():
            predicted, measured = case[mode][f"predicted_{quantity}"], case["measured"][quantity]
            assert error == pytest.approx(predicted / measured - 1)
    assert "assumption" in case["compute_source_catalog"]  # a fresh store: no probe, said so
    assert out.with_suffix(".png").stat().st_size > 0 and "default-60: step_time_s:" in done.stdout
