"""benchmarks/plan_scale_out.py honours --out for everything it writes: a trial run never replaces the docs image."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "plan_scale_out.py"
DOCS_IMAGE = ROOT / "docs" / "img" / "plan_scale_out.png"


def test_a_run_with_its_own_out_leaves_the_docs_image_alone(tmp_path: Path) -> None:
    before = DOCS_IMAGE.stat().st_mtime_ns
    out = tmp_path / "p.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["rows"] and out.with_suffix(".md").read_text().startswith("|")
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert DOCS_IMAGE.stat().st_mtime_ns == before and "copied" not in done.stdout
