"""benchmarks/bench_fp8_numerics.py runs every torchao recipe on the CPU (torch._scaled_mm) beside bf16 seeds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_fp8_numerics.py"


def test_recipes_and_seeds_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    args = [
        "--quick",
        "--seeds",
        "2",
        "--dim",
        "64",
        "--layers",
        "2",
        "--context",
        "32",
        "--micro-batch-size",
        "4",
    ]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = {(r["variant"], r["seed"]): r for r in report["runs"]}
    variants = ["bf16", "fp8 tensorwise", "fp8 rowwise", "fp8 rowwise_with_gw_hp", "fp8 tensorwise + head"]
    assert set(runs) == {(v, s) for v in variants for s in (0, 1)}
    # 2 blocks × (wq, wk, wv, wo, w1, w2, w3); the head (vocabulary 65 padded to 80 rows) only when asked for
    assert [runs[(v, 0)]["fp8_linears"] for v in variants] == [0, 14, 14, 14, 15]
    for run in report["runs"]:
        assert len(run["losses"]) == 6 and all(np.isfinite(run["losses"])), run
    # A seed fixes the initial weights and the batches: at step 0 an fp8 run sees bf16's model and batch, so its
    # loss differs only by rounding; another seed starts elsewhere.
    for seed in (0, 1):
        first = runs[("bf16", seed)]["losses"][0]
        for v in variants[1:]:
            assert runs[(v, seed)]["losses"][0] == pytest.approx(first, rel=0.01), (v, seed)
    assert runs[("bf16", 0)]["losses"][0] != runs[("bf16", 1)]["losses"][0]
    summary = report["summary"]
    assert summary["bf16"]["val_relative_to_bf16"] == 0.0
    for v in variants:
        val = [runs[(v, s)]["val_loss"] for s in (0, 1)]
        base = np.mean([runs[("bf16", s)]["val_loss"] for s in (0, 1)])
        assert summary[v]["val_relative_to_bf16"] == pytest.approx(np.mean(val) / base - 1)
        assert summary[v]["val_seed_spread_relative"] == pytest.approx((max(val) - min(val)) / np.mean(val))
        paired = [runs[(v, s)]["val_loss"] / runs[("bf16", s)]["val_loss"] - 1 for s in (0, 1)]
        assert summary[v]["val_paired_relative"] == pytest.approx(paired)
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "fp8 rowwise_with_gw_hp" in done.stdout

    bad = subprocess.run([sys.executable, str(SCRIPT), "--dim", "40"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--dim a positive multiple of 16" in bad.stderr
