"""benchmarks/gpu_llama8b.py keeps working on CPU (llama-tiny's shape through every phase: estimate, HF checkpoint,
`gaudi3 train --model.init_from`, `gaudi3 ckpt export`), so a GPU session only has to run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import oracles_env

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_llama8b.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = oracles_env(dict(os.environ))  # the script writes its Hugging Face checkpoint with transformers
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, env=env
    )


def test_small_dry_run_estimates_trains_from_the_hf_checkpoint_and_exports(tmp_path: Path) -> None:
    out = tmp_path / "llama8b.json"
    done = _run("--small", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    phases, model = result["phases"], result["model"]
    chosen = phases["estimate"]["chosen"]
    # The fastest candidate (no offload on a CPU, no activation checkpointing, bf16-mixed) fits a tiny model.
    assert (chosen["offload"], chosen["activation_checkpointing"], chosen["precision"], chosen["save"]) == (
        "none", False, "bf16-mixed", True
    )  # fmt: skip
    assert all(c["offload"] == "none" for c in phases["estimate"]["candidates"])
    assert phases["write"]["status"] == "ok" and phases["write"]["files"] > 1  # sharded
    train = phases["train"]
    assert train["status"] == "ok" and train["measured_steps"] == 17 and train["precision"] == "bf16-mixed", (
        train
    )
    assert train["train_loss"] < 7.0  # random init over 512 ids: ln 512 = 6.24, not a broken load
    assert train["memory_error"] == pytest.approx(
        (chosen["estimate_bytes"] - train["peak_memory_bytes"]) / train["peak_memory_bytes"]
    )
    assert train["mfu"] == pytest.approx(
        train["tokens_per_s"] * model["flops_per_token"] / result["peak_flops"]
    )
    export = phases["export"]
    assert export["status"] == "ok" and export["complete"] and export["parameters"] == model["parameters"]
    assert result["verdict"].startswith("llama-tiny fsdp 1 rank, bf16-mixed, offload none, act.ckpt off: ")
    assert result["machine"]["git_commit"] and f"verdict: {result['verdict']}" in done.stdout


def test_bad_input_exits_2() -> None:
    bad = _run("--small", "--budget-s", "0")
    assert bad.returncode == 2 and "--budget-s must be positive, got 0.0" in bad.stderr
    bad = _run("--small", "--precisions", "fp8")
    assert (
        bad.returncode == 2 and "--precisions must be some of bf16-mixed, bf16-true, got 'fp8'" in bad.stderr
    )


def test_a_spent_budget_leaves_the_estimate_and_the_phase_it_stopped(tmp_path: Path) -> None:
    out = tmp_path / "llama8b.json"
    done = _run("--small", "--budget-s", "2", "--precisions", "bf16-true", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["phases"]["estimate"]["chosen"]["precision"] == "bf16-true"
    assert {c["precision"] for c in result["phases"]["estimate"]["candidates"]} == {"bf16-true"}
    assert result["phases"]["write"]["status"] == "timeout" and "train" not in result["phases"]
    assert result["verdict"] == "llama-tiny fsdp 1 rank, bf16-true, offload none, act.ckpt off: write timeout"


def test_a_run_cut_short_never_replaces_a_complete_result(tmp_path: Path) -> None:
    """A 1 s budget stops the run in its write phase: the stored complete result stays, the partial one beside it."""
    out = tmp_path / "llama8b.json"
    ok = {"status": "ok"}
    stored = json.dumps({"phases": {"estimate": {"chosen": {"precision": "bf16-true"}}, "write": ok, "train": ok,
                                    "export": ok}, "verdict": "stored"})  # fmt: skip
    out.write_text(stored)
    done = _run("--small", "--budget-s", "1", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert out.read_text() == stored
    partial = json.loads((tmp_path / "llama8b.partial.json").read_text())
    assert partial["phases"]["write"]["status"] != "ok" and f"kept {out}" in done.stderr
