"""benchmarks/bench_tp.py: each device's results in their own file, and bad counts refused before any launch."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_tp.py"


def test_the_default_out_follows_the_device() -> None:
    """`--device cuda` without --out must not land in (and replace) the CPU results, tp_cpu.json."""
    spec = importlib.util.spec_from_file_location("bench_tp", SCRIPT)
    assert spec and spec.loader
    bench_tp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_tp)
    assert bench_tp.default_out("cuda") == SCRIPT.parent / "results" / "tp_cuda.json"
    assert bench_tp.default_out("cpu") == SCRIPT.parent / "results" / "tp_cpu.json"


@pytest.mark.parametrize(("flag", "value"), [("--repeats", "0"), ("--steps", "-1"), ("--micro", "x")])
def test_bad_counts_exit_2(tmp_path: Path, flag: str, value: str) -> None:
    out = tmp_path / "tp.json"
    bad = subprocess.run([sys.executable, str(SCRIPT), flag, value, "--out", str(out)], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and f"argument {flag}:" in bad.stderr and "Traceback" not in bad.stderr
    assert not out.exists()
