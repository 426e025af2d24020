"""`gaudi3 deploy render` for Gaudi as users run it (a subprocess): every rendered run config trains on hpu (`auto`
would train on the CPU of a node whose Gaudis the runtime did not find), a config the trainer refuses on hpu is
refused at render time (one line, exit 2), and the Gaudi-specific files say they are not yet validated on Gaudi
hardware."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gaudi3_scale.deploy.ci import repro_argv
from gaudi3_scale.deploy.ci_options import ci_options
from gaudi3_scale.deploy.containers import NOT_VALIDATED
from gaudi3_scale.deploy.spec import DeploySpec

BASE = "name: g3\nmodel:\n  name: llama-tiny\n  num_layers: 1\ntrain:\n  global_batch_size: 16\n  max_steps: 10\n"


def _render(tmp_path: Path, config: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "run.yaml").write_text(config)
    cmd = [sys.executable, "-m", "gaudi3_scale.cli", "deploy", "render", "--accelerator", "gaudi3", "--nodes", "2",
           "--config", "run.yaml", "--out", "out", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ))


def test_k8s_and_onprem_gaudi_renders_train_on_hpu_and_say_not_validated(tmp_path: Path) -> None:
    # two on-prem nodes keep --out on their own disks: node 1 resumes from the mirror
    mirrored = BASE + "checkpoint:\n  remote_url: s3://bucket/g3\n"
    done = _render(tmp_path, mirrored, "--target", "onprem", "--hosts", "h1,h2")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    for run_yaml in ("ansible/files/run.yaml", "docker/run.yaml"):
        assert yaml.safe_load((out / run_yaml).read_text())["train"]["device"] == "hpu", run_yaml
    for labelled in ("ansible/files/gaudi3-node", "ansible/playbook.yaml", "metaflow/run.sh"):
        assert NOT_VALIDATED in (out / labelled).read_text(), labelled
    (tmp_path / "k8s").mkdir()
    done = _render(tmp_path / "k8s", BASE, "--target", "k8s")
    assert done.returncode == 0, done.stderr
    config_map = yaml.safe_load((tmp_path / "k8s/out/k8s/base/02-config.yaml").read_text())
    assert yaml.safe_load(next(iter(config_map["data"].values())))["train"]["device"] == "hpu"


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        ("  device: cpu\n", "train.device: 'cpu' in a Gaudi deployment (--accelerator gaudi3); allowed: hpu, or "
         "auto (rendered as hpu)"),
        ("parallel:\n  strategy: deepspeed_zero2\n", "parallel.strategy: deepspeed_zero2 is not available on Gaudi"),
        ("  compile: true\n  compile_mode: reduce-overhead\n", "train.compile_mode: reduce-overhead captures CUDA "
         "graphs, which need a CUDA device, but this run trains on hpu; allowed here: default\n"),
        ("  compile: true\n  compile_mode: max-autotune\n", "train.compile_mode: max-autotune tunes Inductor's "
         "kernels, and torch.compile on Intel Gaudi runs Habana's graph compiler (hpu_backend); allowed there: "
         "default\n"),
    ],
)  # fmt: skip
def test_a_config_the_trainer_refuses_on_hpu_is_refused_at_render(
    tmp_path: Path, extra: str, line: str
) -> None:
    done = _render(tmp_path, BASE + extra, "--target", "k8s")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"gaudi3: error: {line}") and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("runs_on", "device_args"), [(None, ["--train.device=cpu"]), ("self-hosted,gaudi3", [])]
)
def test_ci_repro_on_a_hosted_runner_trains_a_gaudi_config_on_the_cpu(
    runs_on: str | None, device_args: list[str]
) -> None:
    extra = {"repro_runs_on": runs_on} if runs_on else {}
    spec = DeploySpec(target="ci", accelerator="gaudi3", nodes=1, per_node=1, config_path=Path("run.yaml"),
                      run_config=yaml.safe_load(BASE), name="g3", image="registry.example/train:1", extra=extra)  # fmt: skip
    assert spec.run_config["train"]["device"] == "hpu"  # docker/run.yaml, which the repro tier trains
    argv = repro_argv(spec, ci_options(spec))
    assert [a for a in argv if a.startswith("--train.device")] == device_args
