"""benchmarks/bench_health.py runs `gaudi3 train` with the health checks on and off in alternated pairs and records
each pair's step times and ratio, with the machine, as JSON and a PNG (one short pair on one rank here);
benchmarks/bench_health_rollback_plot.py plots a run with an injected spike and its rollback against its twin."""

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
    # A stored run with a 2-rank cell: this run measures 1 rank only, so that cell stays, with its machine.
    old_machine = {"cpu": "older CPU", "date": "2026-11-29T03:59:16+00:00"}
    old_two = {"ranks": 2, "steps": 300, "pairs": [], "median_ratio": 1.004, "overhead_percent": 0.4}
    old_one = {**old_two, "ranks": 1}
    out.write_text(json.dumps({"machine": old_machine, "cells": [old_one, old_two], "interleaved": []}))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "40", "--pairs", "1", "--ranks", "1", "--interleaved-steps", "60",
         "--interleaved-ranks", "1", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    cell, kept = result["cells"]
    assert kept == {**old_two, "machine": old_machine} and cell["machine"] == result["machine"]
    (pair,) = cell["pairs"]
    assert cell["ranks"] == 1 and pair["on_step_time_s"] > 0 and pair["off_step_time_s"] > 0
    assert pair["ratio"] == pytest.approx(pair["on_step_time_s"] / pair["off_step_time_s"])
    assert cell["median_ratio"] == pair["ratio"] and result["machine"]["cpu_count"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert "1 rank(s): health on / off = " in done.stdout
    assert [cell["ranks"] for cell in result["interleaved"]] == [1, 2]  # the 2-rank one under torchrun
    for interleaved in result["interleaved"]:
        # steps 31-60, less the two around each metrics record (31, 40, 41, 50, 51, 60): as many on each side
        assert interleaved["guarded_steps"] + interleaved["unguarded_steps"] == 60 - 30 - 6
        assert abs(interleaved["guarded_steps"] - interleaved["unguarded_steps"]) <= 1
        assert interleaved["median_ratio"] == pytest.approx(
            interleaved["median_guarded_step_s"] / interleaved["median_unguarded_step_s"]
        )
    assert "interleaved, 2 rank(s): guarded / unguarded step = " in done.stdout


ROLLBACK_PLOT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_health_rollback_plot.py"


def test_the_rollback_plot_shows_a_real_spike_and_its_rollback(tmp_path: Path) -> None:
    """A short pair: the spike of data step 27 rolls back to the checkpoint of step 25 and skips batches 25-29."""
    import matplotlib.image

    # Without --png the plot goes beside --out: a trial run never replaces the image the docs show.
    out, png = tmp_path / "rollback.json", tmp_path / "rollback.png"
    docs_image = ROLLBACK_PLOT.parents[1] / "docs" / "img" / "health_rollback.png"
    docs_before = docs_image.stat().st_mtime_ns
    done = subprocess.run(
        [sys.executable, str(ROLLBACK_PLOT), "--steps", "40", "--spike-step", "27", "--checkpoint-every", "5",
         "--skip-batches", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["rollback"] == {"from_step": 27, "to_step": 25, "checkpoint": "step-00000025",
                                  "skipped_batches": [25, 29]}  # fmt: skip
    spike = result["spike"]
    assert spike["step"] == 27 and spike["event_loss"] > 10 * result["final_train_loss"]["twin"]
    # The same batches up to the restored step, bit for bit; then other batches.
    assert result["identical_until_step"] == 25
    spiking, twin = result["runs"]["rolled_back"], result["runs"]["twin"]
    assert [s for s, _ in spiking["train_loss"]] == [s for s, _ in twin["train_loss"]] == list(range(1, 41))
    assert twin["health_records"] == [] and twin["health"]["rollback"] == 0
    assert spiking["health"]["rollback"] == 1 and spiking["health"]["skipped_batches"] == [25, 26, 27, 28, 29]
    assert result["machine"]["cpu_count"] and result["png"] == str(png)
    height, width, _ = matplotlib.image.imread(png).shape
    assert (width, height) == (1320, 594)  # 12 × 5.4 in at 110 dpi
    assert "rolled back 27 → 25, batches 25–29 skipped; runs bitwise equal up to step 25" in done.stdout
    assert docs_image.stat().st_mtime_ns == docs_before
