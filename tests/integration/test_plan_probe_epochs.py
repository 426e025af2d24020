"""`gaudi3 plan --probe` of a config whose length is in epochs (`train.max_epochs` in its file) and that profiles
(`train.profile_start_step`, a window past the probe's few steps): the probe runs (its own length in steps, the
user's max_epochs and profiler unset) and the forecast comes from it, for the steps train resolves the epochs to —
not a warning and the catalog."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_a_probe_of_an_epoch_based_profiling_config_runs_and_the_forecast_uses_it(tmp_path: Path) -> None:
    config = tmp_path / "epochs.yaml"
    config.write_text("model:\n  name: llama-tiny\ntrain:\n  max_epochs: 1\n  profile_start_step: 400\n")
    env = {**os.environ, "GAUDI3_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "plan", "--config", str(config), "--probe",
                           "--out", "p.json"], capture_output=True, text=True, env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    # "--probe: the probe run failed (… both set …)", "(… steps 400..404 go past the last step …)"
    assert "warning" not in done.stderr, done.stderr
    forecast = json.loads((tmp_path / "p.json").read_text())
    assert forecast["run"]["probed"] is True
    assert forecast["step"]["step_time_s"]["source"].startswith("measured: probe of this layout")
    (store,) = (tmp_path / "cache" / "calibration").glob("*.json")
    (probe,) = json.loads(store.read_text())["probes"].values()
    assert probe["key"] == forecast["run"]["probe_key"]
    # the forecast is of the run's length, one epoch as train resolves it, not the probe's few steps
    assert forecast["run"]["max_steps"] > probe["measured_steps"] + probe["warmup_steps"]
