"""The README's main command, exactly as a user runs it: the published shakespeare-char run, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_readme_train_command_reaches_the_published_val_loss(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    assert "python3 run.py train\n" in readme and "python3 run.py test\n" in readme
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "train", "--out", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2000
    # nanoGPT README: this model shape on a CPU reaches val loss 1.88 after 2,000 iterations — a figure given to two
    # decimals, so anything that rounds to 1.88 reaches it (seed-to-seed spread is ±0.01; README "Performance").
    assert summary["val_loss"] < 1.885, summary
    sample = proc.stdout.split("---- sample ----", 1)[1]
    assert len(sample.strip()) > 100
