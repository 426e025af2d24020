"""The Metaflow flow end to end on Metaflow's local runtime (a tiny config, a few real training steps on CPU), and
its Kubernetes switch."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

with warnings.catch_warnings():
    # Metaflow's vendored PyYAML imports the old top-level `_yaml` module, which warns (not our code).
    warnings.filterwarnings("ignore", "The _yaml extension module", DeprecationWarning)
    from gaudi3_scale.deploy.flow import GAUDI_RESOURCE, kubernetes_settings

FLOW = [sys.executable, "-m", "gaudi3_scale.deploy.flow"]
TINY = """\
name: flow-tiny
model: {name: shakespeare-char, num_layers: 1, num_heads: 2, dim: 32, context_length: 32}
optim: {lr: 0.01, warmup_steps: 2}
train: {global_batch_size: 8, max_epochs: 50, val_every_steps: 20, val_batches: 2, log_every_steps: 2, threads: 2}
checkpoint: {every_steps: 20, async_save: false}
benchmark: {warmup_steps: 2}
"""
STEPS = 20  # the flow's --steps replaces the config's length in epochs (thousands of steps)


def _metaflow_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("METAFLOW_", "GAUDI3_METAFLOW_"))}
    return env | {"METAFLOW_HOME": str(tmp / "mf-home"), "METAFLOW_DATASTORE_SYSROOT_LOCAL": str(tmp / "mf"),
                  "USERNAME": "gaudi3-test", **extra}  # fmt: skip


@pytest.fixture(scope="module")
def flow_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict[str, str], subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("flow")
    config = tmp / "tiny.yaml"
    config.write_text(TINY)
    env = _metaflow_env(tmp)
    out = tmp / "out"
    cmd = [*FLOW, "--no-pylint", "run", "--config", str(config), "--out", str(out), "--steps", str(STEPS),
           "--tune", "estimate", "--accelerator", "gaudi3"]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    return out, env, done


@pytest.mark.integration
def test_flow_runs_every_step_and_trains(
    flow_run: tuple[Path, dict[str, str], subprocess.CompletedProcess],
) -> None:
    out, _, done = flow_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for name in ("start", "prepare", "tune", "train", "report", "end"):
        assert f"/{name}/" in done.stdout + done.stderr, name  # Metaflow logs each task as Flow/run/step/task
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["steps"] == STEPS
    losses = [json.loads(line)["train_loss"] for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
              if '"train_loss"' in line]  # fmt: skip
    assert losses[-1] < losses[0] < math.log(65) + 0.5  # 65 characters: it learned more than a uniform guess
    assert (out / "data" / "manifest.json").is_file()  # the prepare step's data, reused by train
    config = yaml.safe_load((out / "run" / "config.yaml").read_text())
    assert config["data"]["prepared_dir"] == str(out / "data") and config["train"]["max_steps"] == STEPS
    report = out / "report"
    assert (report / "report.md").is_file() or any(p.suffix == ".md" for p in report.iterdir())
    assert any(p.suffix == ".html" for p in report.iterdir()) and any(
        p.suffix == ".csv" for p in report.iterdir()
    )


@pytest.mark.integration
def test_flow_artifacts_hold_the_results(
    flow_run: tuple[Path, dict[str, str], subprocess.CompletedProcess],
) -> None:
    out, env, done = flow_run
    assert done.returncode == 0, done.stderr[-4000:]
    read = ("import json; from metaflow import Flow, namespace; namespace(None); d = Flow('Gaudi3TrainFlow')"
            ".latest_run.data; print(json.dumps({'summary': d.summary, 'result': d.benchmark_result, "
            "'tune': d.tune_report, 'report': d.report_files, 'tokens': d.data_tokens, 'best': d.best_config}))")  # fmt: skip
    got = subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    data = json.loads(got.stdout)
    assert data["summary"] == json.loads((out / "run" / "summary.json").read_text())
    assert (
        data["result"]["schema"].startswith("gaudi3-scale") and data["result"]["metrics"]["tokens_per_s"] > 0
    )
    assert "gaudi3" in data["tune"].lower()  # the estimate table for the --accelerator
    assert data["best"] is None  # estimate only: nothing tuned
    assert data["tokens"]["train"] > data["tokens"]["val"] > 0
    assert sorted(data["report"]) == sorted(p.name for p in (out / "report").iterdir())


def test_kubernetes_switch_puts_kubernetes_on_every_step(tmp_path: Path) -> None:
    """With GAUDI3_METAFLOW_KUBERNETES=1 every step carries @kubernetes (Metaflow itself then refuses the local
    datastore, which @kubernetes cannot use), and the accelerated steps request the devices."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    env = _metaflow_env(tmp_path, GAUDI3_METAFLOW_KUBERNETES="1", GAUDI3_METAFLOW_ACCELERATOR="gaudi3",
                        GAUDI3_METAFLOW_DEVICES="8")  # fmt: skip
    show = ("from gaudi3_scale.deploy.flow import Gaudi3TrainFlow as F; import json; print(json.dumps({n: "
            "[[d.name, d.attributes.get('extended_resources')] for d in getattr(F, n).decorators] for n in "
            "['start', 'prepare', 'tune', 'train', 'report', 'end']}))")  # fmt: skip
    got = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    decorators = {step: dict(decos) for step, decos in json.loads(got.stdout).items()}
    for name, decos in decorators.items():
        assert sorted(decos) == ["environment", "kubernetes"], name
    requested = {step: decos["kubernetes"] for step, decos in decorators.items()}
    assert requested == {"start": {}, "prepare": {}, "tune": {GAUDI_RESOURCE: "8"}, "train": {GAUDI_RESOURCE: "8"},
                         "report": {}, "end": {}}  # fmt: skip
    run = subprocess.run([*FLOW, "--no-pylint", "run", "--config", str(config), "--out", str(tmp_path / "o")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode != 0
    assert "@kubernetes" in run.stdout + run.stderr and "--datastore=s3" in run.stdout + run.stderr
    assert not (tmp_path / "o").exists()  # refused before any step ran
    off = subprocess.run(
        [sys.executable, "-c", show], env=_metaflow_env(tmp_path), capture_output=True, text=True
    )
    assert all(decos == [] for decos in json.loads(off.stdout).values())


def test_kubernetes_settings() -> None:
    assert kubernetes_settings(False, {"GAUDI3_METAFLOW_ACCELERATOR": "gaudi3"}) == {}
    gaudi = {"GAUDI3_METAFLOW_ACCELERATOR": "gaudi2", "GAUDI3_METAFLOW_DEVICES": "4"}
    assert kubernetes_settings(True, gaudi) == {"extended_resources": {"habana.ai/gaudi": "4"}}
    nvidia = {"GAUDI3_METAFLOW_ACCELERATOR": "h100", "GAUDI3_METAFLOW_DEVICES": "8"}
    assert kubernetes_settings(True, nvidia) == {"gpu": 8, "gpu_vendor": "nvidia"}
    with pytest.raises(ValueError, match="GAUDI3_METAFLOW_DEVICES"):
        kubernetes_settings(True, {"GAUDI3_METAFLOW_DEVICES": "0"})


@pytest.mark.integration
def test_the_flow_trains_its_pods_devices_on_one_node(tmp_path: Path) -> None:
    """GAUDI3_METAFLOW_DEVICES (what `metaflow/run.sh` exports: the deployment's devices per node, which @kubernetes
    requests) is the number of ranks the train step runs, on one node, even for a config written for a cluster."""
    config = tmp_path / "cluster.yaml"
    config.write_text(
        TINY + "parallel: {nnodes: 2, node_rank: 1, rdzv_endpoint: 'node0:29500', rdzv_timeout_s: 5}\n"
    )
    out = tmp_path / "out"
    env = _metaflow_env(tmp_path, GAUDI3_METAFLOW_DEVICES="2")
    done = subprocess.run([*FLOW, "--no-pylint", "run", "--config", str(config), "--out", str(out), "--steps", "4",
                           "--tune", "off"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    resolved = yaml.safe_load((out / "run" / "config.yaml").read_text())["parallel"]
    assert (resolved["nnodes"], resolved["nproc_per_node"], resolved["node_rank"]) == (1, 2, 0)
    assert resolved["rdzv_endpoint"] is None  # its own loopback, not the file's node0
    assert json.loads((out / "run" / "summary.json").read_text())["steps"] == 4


def test_node_overrides_resolve_to_one_node_of_the_pods_devices(tmp_path: Path) -> None:
    from gaudi3_scale.deploy.flow import node_overrides
    from gaudi3_scale.train.config import resolve_config

    config = tmp_path / "cluster.yaml"
    config.write_text(TINY + "parallel: {nnodes: 8, node_rank: 3, rdzv_endpoint: 'node0:29500'}\n")
    cfg = resolve_config(str(config), node_overrides({"GAUDI3_METAFLOW_DEVICES": "2"}))
    assert (cfg.parallel.nnodes, cfg.parallel.nproc_per_node, cfg.parallel.node_rank) == (1, 2, 0)
    assert cfg.parallel.rdzv_endpoint is None
    with_eight = tmp_path / "eight.yaml"
    with_eight.write_text(TINY + "parallel: {nproc_per_node: 8}\n")
    # unset: as many ranks as kubernetes_settings asks devices (1), not the config's 8
    assert resolve_config(str(with_eight), node_overrides({})).parallel.nproc_per_node == 1
    assert kubernetes_settings(True, {"GAUDI3_METAFLOW_ACCELERATOR": "h100"})["gpu"] == 1
    with pytest.raises(ValueError, match="GAUDI3_METAFLOW_DEVICES"):
        node_overrides({"GAUDI3_METAFLOW_DEVICES": "0"})
