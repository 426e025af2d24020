"""What `gaudi3 deploy render` checks of the deployment as a whole before it writes a file: the device the run
trains on, ranks per node against the instance rented, the cost settings against what is rendered, Kubernetes
quantities, and the names the Terraform derives (GCP service accounts)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from gaudi3_scale.deploy.instances import instance_for

Cli = Callable[..., tuple[int, str, str]]
BASE = """\
name: {name}
model: {{num_layers: 1}}
train: {{global_batch_size: 5040, max_steps: 5{train}}}  # splits over 1-10 ranks per node on 2 nodes
"""


def _render(gaudi3_cli: Cli, tmp_path: Path, target: str, accelerator: str, *args: str,
            name: str = "spec-run", train: str = "", extra: str = "") -> tuple[int, str, str, Path]:  # fmt: skip
    config = tmp_path / f"{name}.yaml"
    config.write_text(BASE.format(name=name, train=train) + extra)
    out = tmp_path / f"out-{name}-{target}"
    nodes = "1" if target == "ci" else "2"  # a CI runner is one machine
    code, stdout, stderr = gaudi3_cli("deploy", "render", "--target", target, "--accelerator", accelerator,
                                      "--nodes", nodes, *args, "--config", str(config), "--out", str(out))  # fmt: skip
    return code, stdout, stderr, out


def _refused(result: tuple[int, str, str, Path], *needles: str) -> None:
    code, out, err, files = result
    assert code == 2 and out == "", (code, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not files.exists()


@pytest.mark.parametrize("accelerator", ["h100", "h200", "a100"])
@pytest.mark.parametrize("device", ["cpu", "hpu"])
@pytest.mark.parametrize("target", ["k8s", "aws", "onprem"])
def test_a_gpu_deployment_refuses_another_device(
    gaudi3_cli: Cli, tmp_path: Path, accelerator: str, device: str, target: str
) -> None:
    hosts = ["--hosts", "a,b"] if target == "onprem" else []
    if target == "aws" and accelerator == "h200":
        pytest.skip("the catalog has no aws h200 instance")
    result = _render(gaudi3_cli, tmp_path, target, accelerator, *hosts, train=f", device: {device}")
    _refused(result, "train.device", repr(device), "allowed: auto, cuda")


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_a_gpu_deployment_trains_on_cuda(gaudi3_cli: Cli, tmp_path: Path, device: str) -> None:
    code, _, err, out = _render(gaudi3_cli, tmp_path, "k8s", "h100", train=f", device: {device}")
    assert code == 0, err
    assert yaml.safe_load((out / "docker" / "run.yaml").read_text())["train"]["device"] == "cuda"


def test_the_ci_target_keeps_the_cpu_for_its_hosted_runner_but_refuses_hpu(
    gaudi3_cli: Cli, tmp_path: Path
) -> None:
    code, _, err, _ = _render(gaudi3_cli, tmp_path, "ci", "h100", "--per-node", "1", train=", device: cpu")
    assert code == 0, err
    _refused(_render(gaudi3_cli, tmp_path, "ci", "h100", "--per-node", "1", name="hpu", train=", device: hpu"),
             "train.device", "allowed: auto, cuda, cpu")  # fmt: skip


@pytest.mark.parametrize("target", ["aws", "gcp", "azure"])
def test_per_node_above_the_instance_is_refused(gaudi3_cli: Cli, tmp_path: Path, target: str) -> None:
    instance = instance_for(target, "h100")
    more = str(instance.accelerators_per_node + 1)
    _refused(_render(gaudi3_cli, tmp_path, target, "h100", "--per-node", more),
             "--per-node", instance.type, f"allowed: 1-{instance.accelerators_per_node}")  # fmt: skip
    code, _, err, _ = _render(gaudi3_cli, tmp_path, target, "h100", "--per-node", "4", name="four")
    assert code == 0, err


def test_a_cost_instance_other_than_the_rendered_one_is_refused(gaudi3_cli: Cli, tmp_path: Path) -> None:
    rendered = instance_for("aws", "a100").type
    cost = "cost: {instance: aws/p5.48xlarge/us-east-1}\n"
    _refused(_render(gaudi3_cli, tmp_path, "aws", "a100", extra=cost), "cost.instance", f"aws/{rendered}")
    _refused(_render(gaudi3_cli, tmp_path, "gcp", "h100", extra=cost), "cost.instance", "gcp/")
    ok = f"cost: {{instance: aws/{rendered}/us-east-1}}\n"
    code, _, err, _ = _render(gaudi3_cli, tmp_path, "aws", "a100", name="same", extra=ok)
    assert code == 0, err
    # k8s and onprem rent nothing: any catalog instance may describe their nodes
    code, _, err, _ = _render(gaudi3_cli, tmp_path, "k8s", "a100", name="k8s", extra=cost)
    assert code == 0, err


@pytest.mark.parametrize("pricing", ["spot", "capacity_block"])
def test_spot_pricing_on_on_demand_capacity_is_refused(gaudi3_cli: Cli, tmp_path: Path, pricing: str) -> None:
    rendered = instance_for("aws", "h100").type
    cost = f"cost: {{instance: aws/{rendered}/us-east-1, pricing: {pricing}}}\n"
    _refused(_render(gaudi3_cli, tmp_path, "aws", "h100", extra=cost), "cost.pricing", "allowed: on_demand")


@pytest.mark.parametrize(
    ("setting", "needle"),
    [("storage_size=0Gi", "k8s.storage_size"), ("cpu=0", "k8s.cpu"), ("memory=0Gi", "k8s.memory"),
     ("memory=0.0", "k8s.memory")],
)  # fmt: skip
def test_zero_kubernetes_quantities_are_refused(
    gaudi3_cli: Cli, tmp_path: Path, setting: str, needle: str
) -> None:
    _refused(_render(gaudi3_cli, tmp_path, "k8s", "h100", "--set", setting), needle, "more than 0")


@pytest.mark.parametrize("name", ["storage_size", "shm_size", "hugepages_2mi", "memory"])
def test_a_byte_size_without_its_unit_is_refused(gaudi3_cli: Cli, tmp_path: Path, name: str) -> None:
    code, out, err, _ = _render(gaudi3_cli, tmp_path, "k8s", "h100", "--set", f"{name}=500")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"k8s.{name}: 500 is 500 bytes; write e.g. 500Gi" in err


def test_cpu_may_be_a_number_and_a_byte_size_a_quantity_with_its_unit(
    gaudi3_cli: Cli, tmp_path: Path
) -> None:
    code, _, err, out = _render(
        gaudi3_cli, tmp_path, "k8s", "h100", "--set", "storage_size=500G", "--set", "cpu=16"
    )
    assert code == 0, err
    claim = yaml.safe_load((out / "k8s" / "base" / "03-storage.yaml").read_text())
    assert claim["spec"]["resources"]["requests"]["storage"] == "500G"


@pytest.mark.skipif(shutil.which("terraform") is None, reason="terraform console evaluates the HCL")
def test_gcp_service_accounts_of_long_names_that_share_their_start_differ(
    gaudi3_cli: Cli, tmp_path: Path
) -> None:
    ids = []
    for name in ("llama3-8b-pretrain-fineweb-run1", "llama3-8b-pretrain-fineweb-run2"):
        code, _, err, out = _render(gaudi3_cli, tmp_path, "gcp", "h100", name=name)
        assert code == 0, err
        main_tf = (out / "terraform" / "main.tf").read_text()
        (expression,) = re.findall(r"^\s*account_id\s*=\s*(.+)$", main_tf.split("locals {", 1)[1], re.M)[:1]
        done = subprocess.run(["terraform", "console"], input=expression.replace("var.name", f'"{name}"'),
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        ids.append(done.stdout.strip().strip('"'))
    assert ids[0] != ids[1], ids
    for account in ids:  # Google's rule for service account ids
        assert re.fullmatch(r"[a-z][-a-z0-9]{4,28}[a-z0-9]", account), account
