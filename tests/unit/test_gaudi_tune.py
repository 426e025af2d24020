"""`gaudi3 tune` and `gaudi3 plan` on hpu size the Gaudi this node has, not a Gaudi 3 whatever the card; off Gaudi,
`gaudi3 tune --train.device hpu` is one line before any trial. The detected card is a stand-in
(`device.select.detected_hpu_name`): which Gaudi a node has is hardware-only. Not yet validated on Gaudi hardware."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.device import select
from gaudi3_scale.forecast.run import machine_for
from gaudi3_scale.train.config import build_run_config
from gaudi3_scale.tune.tuner import default_memory_budget


def test_tune_hpu_off_gaudi_is_one_line_before_any_trial(tmp_path: Path) -> None:
    args = ["--model.name=llama-tiny", "--model.num_layers=1", "--train.threads=1", "--train.device=hpu",
            "--out", "tune"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "tune", *args], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "GAUDI3_CACHE": str(tmp_path / "cache")})  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(
        "gaudi3: error: train.device: Gaudi (HPU) was requested but habana_frameworks"
    )
    assert done.stderr.count("\n") == 1 and done.stdout == ""
    assert not (tmp_path / "tune").exists()


@pytest.mark.parametrize(("name", "memory_gb"), [("GAUDI2", 96), ("GAUDI3", 128)])
def test_the_budget_and_the_forecast_are_of_the_gaudi_here(
    monkeypatch: pytest.MonkeyPatch, name: str, memory_gb: int
) -> None:
    monkeypatch.setattr(select, "detected_hpu_name", lambda: name)
    assert default_memory_budget("hpu", 8, 0.5) == int(memory_gb * 1e9 * 0.5)
    cfg = build_run_config(None, [("model.name", "llama-tiny"), ("train.device", "hpu")])
    machine = machine_for(cfg, None)
    assert (machine.kind, machine.device_name) == (name.lower(), name.lower())


def test_no_gaudi_visible_asks_for_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(select, "detected_hpu_name", lambda: None)
    with pytest.raises(
        UserInputError, match=r"^--memory-budget: no Gaudi is visible here to size it from; give it"
    ):
        default_memory_budget("hpu", 8, 0.5)
