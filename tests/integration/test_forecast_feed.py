"""One forecast model for `gaudi3 plan`, `gaudi3 cost compare` and `gaudi3 tune` (docs/foresight.md), as users run
them (subprocesses): cost compare's step time, days and memory are plan's for the same model, tokens and layout;
a tune trial on this CPU lands in the machine's calibration store, and a following `gaudi3 plan` of its layout
forecasts from it and names it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def _gaudi3(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GAUDI3_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def test_cost_compare_takes_its_step_time_days_and_memory_from_plans_model(tmp_path: Path) -> None:
    machine, nodes, devices = "h100", 2, 16  # 2 p5 nodes: traffic over EFA, a communication term to agree on
    # cost compare's layout (Assumptions): FSDP, bf16-mixed, activation checkpointing, one sequence per rank
    plan = _gaudi3(tmp_path, "plan", "--machine", machine, "--nodes", str(nodes), "--model.name", "gpt2-124m",
                   "--parallel.strategy", "fsdp", "--parallel.activation_checkpointing", "true",
                   "--train.precision", "bf16-mixed", "--train.micro_batch_size", "1",
                   "--train.global_batch_size", str(devices), "--out", "plan.json")  # fmt: skip
    cost = _gaudi3(tmp_path, "cost", "compare", "--model", "gpt2-124m", "--tokens", "10B", "--platforms", machine,
                   "--nodes", str(nodes), "--out", "cost")  # fmt: skip
    forecast = _json(tmp_path / "plan.json")
    (row,) = _json(tmp_path / "cost" / "cost.json")["rows"]
    assert row["accelerators"] == forecast["run"]["world_size"] == devices
    assert row["tokens_per_step"] == forecast["run"]["tokens_per_step"] == devices * 1024
    # the same step, from the same figures: equal, not close
    assert row["step_time_s"] == forecast["predicted_step_time_s"]
    assert row["step_time_source"].startswith(forecast["step"]["step_time_s"]["source"])
    assert (
        forecast["step"]["communication_s"]["value"] > 0
    )  # the step has a communication term, and both count it
    days = 10e9 / forecast["run"]["tokens_per_step"] * forecast["predicted_step_time_s"] / 86400
    assert row["train_hours"] / 24 == pytest.approx(days, rel=1e-12)
    assert f"{days:,.1f}" in cost.stdout  # the days column as printed
    assert row["memory_per_device_gib"] * 2**30 == pytest.approx(forecast["memory"]["total_bytes"]["value"])
    assert "step time: model: compute + exposed communication" in cost.stdout
    assert "step s" in cost.stdout and "wrote" in plan.stdout


def test_a_tune_trial_feeds_the_store_and_plan_names_it_as_its_source(tmp_path: Path) -> None:
    tuned = _gaudi3(tmp_path, "tune", "--global-batch", "4", "--precisions", "32-true", "--activation-checkpointing",
                    "off", "--compile", "off", "--threads", "1", "--warmup-steps", "1", "--measure-steps", "2",
                    "--model.num_layers", "1", "--model.dim", "32", "--out", "tune")  # fmt: skip
    report = _json(tmp_path / "tune" / "tune.json")
    ok = [t for t in report["trials"] if t["status"] == "ok"]
    assert len(ok) >= 2  # micro-batch 4 and 2 at least: two layouts
    assert tuned.stdout.count("calibration store: probe of this layout stored") == len(ok)
    (store_path,) = (tmp_path / "cache" / "calibration").glob("*.json")
    probes = _json(store_path)["probes"]
    assert len(probes) == len(ok)  # one per layout
    assert all(p["origin"].startswith("tune trial tune/trials/") for p in probes.values())

    plan = _gaudi3(tmp_path, "plan", "--config", "tune/best.yaml", "--out", "plan.json")
    forecast = _json(tmp_path / "plan.json")
    probe = probes[forecast["run"]["probe_key"]]  # the winner's own trial, under the key plan computes
    best = report["best"]["key"]
    assert probe["origin"] == f"tune trial tune/trials/{best}"
    assert forecast["run"]["probed"] is True
    assert forecast["predicted_step_time_s"] == probe["step_time_s"]
    assert forecast["memory"]["total_bytes"]["value"] == probe["peak_memory_bytes"]
    source = forecast["step"]["step_time_s"]["source"]
    assert source.startswith(f"measured: probe of this layout, from tune trial tune/trials/{best}, ")
    assert f"from tune trial tune/trials/{best}" in plan.stdout
    # another layout on the same machine (the trials ran without activation checkpointing, whatever micro-batches
    # fitted): the trials' achieved rate, not the 0.40 assumption
    _gaudi3(tmp_path, "plan", "--config", "tune/best.yaml", "--parallel.activation_checkpointing", "true", "--out",
            "o.json")  # fmt: skip
    other = _json(tmp_path / "o.json")
    assert other["run"]["probed"] is False
    assert f"median achieved ÷ peak of {len(ok)} probe(s)" in other["step"]["compute_s"]["source"]


def test_tune_estimate_only_prints_plans_memory(tmp_path: Path) -> None:
    """`tune --estimate-only` has no step time; its memory per rank is plan's, from the same estimator and shape."""
    layout = ("--model.name", "gpt2-124m", "--parallel.strategy", "fsdp", "--train.global_batch_size", "16")
    table = _gaudi3(tmp_path, "tune", "--estimate-only", "--world-size", "16", "--accelerator", "h100",
                    "--memory-budget", "80GB", *layout)  # fmt: skip
    _gaudi3(tmp_path, "plan", "--machine", "h100", "--nodes", "2", *layout, "--out", "plan.json")
    forecast = _json(tmp_path / "plan.json")
    row = next(line.split() for line in table.stdout.splitlines() if line.split()[:2] == ["fsdp", "off"])
    header = next(line for line in table.stdout.splitlines() if line.startswith("strategy")).split()
    total_gib = float(row[header.index("total")])
    assert forecast["run"]["layout"]["activation_checkpointing"] is False
    assert total_gib == round(forecast["memory"]["total_bytes"]["value"] / 2**30, 2)
    for part in ("params", "optimizer", "activations", "workspace"):
        assert float(row[header.index(part)]) == round(
            forecast["memory"][f"{part}_bytes"]["value"] / 2**30, 2
        )
