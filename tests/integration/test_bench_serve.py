"""benchmarks/bench_serve.py: `--burst` writes where `--out` says (never over the committed file), and bad counts
are one line on stderr with exit code 2, before any server starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve.py"
COMMITTED = SCRIPT.parent / "results" / "serve" / "serve_burst_cpu.json"
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=ENV,
                          timeout=120)  # fmt: skip


def test_a_burst_honours_out(tmp_path: Path) -> None:
    before = COMMITTED.stat().st_mtime_ns
    out = tmp_path / "burst.json"
    done = _run("--burst", "2", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    (burst,) = json.loads(out.read_text())["bursts"]
    assert burst["clients"] == 2 and sum(burst["outcomes"].values()) == 2 and burst["errors"] == 0
    assert COMMITTED.stat().st_mtime_ns == before


@pytest.mark.parametrize(("flag", "value"), [("--burst", "2,x"), ("--burst", "0"), ("--rounds", "0")])
def test_bad_counts_exit_2(tmp_path: Path, flag: str, value: str) -> None:
    out = tmp_path / "x.json"
    bad = _run(flag, value, "--out", str(out))
    assert bad.returncode == 2 and f"argument {flag}:" in bad.stderr and "Traceback" not in bad.stderr
    assert not out.exists()
