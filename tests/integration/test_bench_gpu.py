"""benchmarks/bench_gpu.py keeps working on CPU (its tiny cell set), so a GPU session only has to run it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"


def test_bench_gpu_runs_both_sides_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_cpu.json"
    args = ["--small", "--cells", "tiny-eager", "--repeats", "1", "--measured-steps", "3", "--no-loss"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    cell = result["cells"]["tiny-eager"]
    for side in ("plain", "gaudi3"):
        assert cell[side]["ms_per_step"] > 0 and 0 < cell[side]["mfu"] < 1, cell
        (run,) = cell["runs"][side]
        # Uniformly random ids over 512: a model that trains on them sits at ln(512) = 6.24 nats.
        assert run["final_loss"] == pytest.approx(math.log(512), abs=0.3), run
    assert cell["ratio_tokens_per_s"] == pytest.approx(
        cell["gaudi3"]["tokens_per_s"] / cell["plain"]["tokens_per_s"]
    )
    assert cell["runs"]["gaudi3"][0]["measured_steps"] == 3
    assert result["machine"]["packages"]["torch"] and result["peak_source"].startswith("measured")
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "tiny-eager" in done.stdout and "×" in done.stdout

    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--cells", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown cell(s) nope; valid: tiny-eager, tiny-compiled" in bad.stderr
