"""`gaudi3 plan --machine` as users run it (a subprocess): the nodes of parallel.nnodes need no rendezvous endpoint
(a forecast contacts none), an explicit parallel.nproc_per_node is honoured or refused above the machine's node in
one line, and `--machine cpu` forecasts this CPU for a config that trains on an accelerator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _plan(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GAUDI3_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "plan", "--out", "p.json", *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path)  # fmt: skip


def test_the_nodes_of_parallel_nnodes_are_forecast_without_a_rendezvous_endpoint(tmp_path: Path) -> None:
    done = _plan(tmp_path, "--machine", "h100", "--parallel.nnodes", "4", "--train.global_batch_size", "64")
    assert done.returncode == 0, done.stderr
    run = json.loads((tmp_path / "p.json").read_text())["run"]
    assert (run["nodes"], run["world_size"], run["machine"]) == (4, 32, "h100-sxm")


def test_an_explicit_nproc_per_node_is_honoured_and_refused_above_the_node(tmp_path: Path) -> None:
    done = _plan(
        tmp_path, "--machine", "h100", "--parallel.nproc_per_node", "4", "--train.global_batch_size", "64"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "p.json").read_text())["run"]["world_size"] == 4
    (tmp_path / "p.json").unlink()
    refused = _plan(
        tmp_path, "--machine", "h100", "--parallel.nproc_per_node", "16", "--train.global_batch_size", "64"
    )
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr == (
        "gaudi3: error: parallel.nproc_per_node: 16 ranks per node, but --machine h100 has 8 devices per node; "
        "allowed: 1 to 8 (unset: the whole node)\n"
    )
    assert not (tmp_path / "p.json").exists()


def test_machine_cpu_forecasts_this_cpu_for_an_accelerator_config(tmp_path: Path) -> None:
    done = _plan(tmp_path, "--machine", "cpu", "--train.device", "cuda")
    assert done.returncode == 0, done.stderr
    run = json.loads((tmp_path / "p.json").read_text())["run"]
    assert run["machine"] == "cpu" and run["layout"]["device_kind"] == "cpu"
