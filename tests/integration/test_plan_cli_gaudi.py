"""`gaudi3 plan` for Gaudi as users run it (a subprocess): a layout the trainer refuses on hpu is refused here too
(one line, exit 2), and a forecast for hpu without a Gaudi visible says which Gaudi it assumed. No Gaudi here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = (
    "--model.name=llama-tiny",
    "--model.num_layers=1",
    "--train.threads=1",
    "--train.global_batch_size=16",
)


def _plan(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GAUDI3_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "plan", *TINY, *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("--machine", "gaudi3", "--parallel.strategy=deepspeed_zero2"), "parallel.strategy"),
        (
            ("--machine", "gaudi2", "--train.compile=true", "--train.compile_mode=reduce-overhead"),
            "train.compile_mode",
        ),
        (("--machine", "h100", "--train.hpu_graphs=true"), "train.hpu_graphs"),
    ],
)
def test_a_layout_the_trainer_refuses_is_not_forecast(
    tmp_path: Path, args: tuple[str, ...], field: str
) -> None:
    done = _plan(tmp_path, *args, "--out", "p.json")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"gaudi3: error: {field}: ") and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "p.json").exists()


def test_hpu_without_a_visible_gaudi_says_which_gaudi_it_assumed(tmp_path: Path) -> None:
    done = _plan(tmp_path, "--train.device=hpu")
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert (
        "of gaudi3 (gaudi3 assumed: no Gaudi visible here; choose with --machine gaudi2|gaudi3)" in first
    ), first
