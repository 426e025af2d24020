"""The rendered image and permissions reach every storage URL the nodes open: the checkpoint bucket a cloud target
creates (every node gets it as --checkpoint.remote_url) and the run config's own data and model URLs.

Which package serves a scheme is fsspec's own table (`fsspec.registry.known_implementations`); which packages an
image holds is pyproject.toml's extras named by the Dockerfile's `ARG EXTRAS`, as its base stage reads them.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from fsspec.registry import known_implementations

Cli = Callable[..., tuple[int, str, str]]
ROOT = Path(__file__).resolve().parents[2]
PLAIN = """\
name: plain-run
model: {num_layers: 1}
train: {global_batch_size: 96, max_steps: 5}
"""
# data on three stores, no checkpoint.remote_url
DATA_URLS = """\
name: data-urls
model: {num_layers: 1}
train: {global_batch_size: 96, max_steps: 5}
data:
  mixture:
    - {source: s3://corpus-bucket/web, weight: 7}
    - {source: gs://code-bucket/code, weight: 2}
    - {source: az://books/b, weight: 1}
"""
S3_DATA = """\
name: s3-data
model: {num_layers: 1}
train: {global_batch_size: 96, max_steps: 5}
data: {source: s3://my-data-bucket/prepared/corpus}
"""


def _render(gaudi3_cli: Cli, tmp_path: Path, text: str, target: str, accelerator: str = "h100") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "run.yaml"
    config.write_text(text)
    out = tmp_path / f"out-{target}"
    code, _, stderr = gaudi3_cli("deploy", "render", "--target", target, "--accelerator", accelerator,
                                      "--nodes", "2", "--config", str(config), "--out", str(out))  # fmt: skip
    assert code == 0, stderr
    return out


def _image_modules(dockerfile: str) -> set[str]:
    """The top-level modules the image's pip install brings for the storage backends: the distributions the
    extras in `ARG EXTRAS` list (pyproject.toml), by their import names (these distributions are named as their
    module)."""
    (extras,) = re.findall(r"^ARG EXTRAS=(.*)$", dockerfile, re.M)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    requirements = [*project["dependencies"], *(r for e in extras.split(",") if e for r in optional[e])]
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("-", "_") for r in requirements}


def _backend_module(url: str) -> str:
    """The module fsspec imports for `url`'s scheme (`s3fs.S3FileSystem` → s3fs)."""
    return known_implementations[url.partition("://")[0]]["class"].split(".")[0]


@pytest.mark.parametrize("target", ["aws", "gcp", "azure"])
def test_a_cloud_image_holds_the_backend_of_the_bucket_its_terraform_creates(
    gaudi3_cli: Cli, tmp_path: Path, target: str
) -> None:
    out = _render(gaudi3_cli, tmp_path, PLAIN, target)
    main_tf = (out / "terraform" / "main.tf").read_text()
    (checkpoint_url,) = re.findall(r'^\s*checkpoint_url\s*=\s*"([a-z0-9]+://)', main_tf, re.M)
    assert _backend_module(checkpoint_url) in _image_modules((out / "docker" / "Dockerfile").read_text())


@pytest.mark.parametrize("target", ["k8s", "aws"])
def test_the_image_holds_the_backend_of_every_data_url(gaudi3_cli: Cli, tmp_path: Path, target: str) -> None:
    out = _render(gaudi3_cli, tmp_path, DATA_URLS, target)
    modules = _image_modules((out / "docker" / "Dockerfile").read_text())
    for url in ("s3://corpus-bucket/web", "gs://code-bucket/code", "az://books/b"):
        assert _backend_module(url) in modules, url


def test_a_url_without_a_backend_in_the_image_is_refused(gaudi3_cli: Cli, tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(PLAIN + "data: {cache_dir: 'hdfs://namenode/cache'}\n")
    code, out, err = gaudi3_cli("deploy", "render", "--target", "k8s", "--accelerator", "h100", "--nodes", "2",
                                "--config", str(config), "--out", str(tmp_path / "o"))  # fmt: skip
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "data.cache_dir: hdfs://" in err, err


def test_k8s_pods_get_the_credentials_secret_when_data_is_on_s3(gaudi3_cli: Cli, tmp_path: Path) -> None:
    job = yaml.safe_load(
        (_render(gaudi3_cli, tmp_path / "s3", S3_DATA, "k8s") / "k8s" / "pytorchjob.yaml").read_text()
    )
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        assert container["envFrom"] == [{"secretRef": {"name": "s3-data-checkpoint-credentials"}}]
    plain = yaml.safe_load(
        (_render(gaudi3_cli, tmp_path / "plain", PLAIN, "k8s") / "k8s" / "pytorchjob.yaml").read_text()
    )
    assert (
        "envFrom" not in plain["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    )


def _default(hcl2: Any, variables_tf: Path, name: str) -> Any:
    """A variable's default as python-hcl2 reads it, string quotes off."""
    with open(variables_tf) as f:
        blocks = {k.strip('"'): v for block in hcl2.load(f)["variable"] for k, v in block.items()}
    default = blocks[name]["default"]
    return {k.strip('"'): v.strip('"') for k, v in default.items()} if isinstance(default, dict) else default


def test_the_aws_instance_role_may_read_the_data_bucket(gaudi3_cli: Cli, tmp_path: Path) -> None:
    hcl2 = pytest.importorskip("hcl2")
    terraform = _render(gaudi3_cli, tmp_path, S3_DATA, "aws") / "terraform"
    assert _default(hcl2, terraform / "variables.tf", "data_buckets") == {"my-data-bucket": "data.source"}
    main_tf = (terraform / "main.tf").read_text()
    read = main_tf[main_tf.index('sid       = "ReadData"') :][:300]
    assert '"s3:GetObject"' in read and "keys(var.data_buckets)" in read and ':::${b}/*"' in read
    plain = _render(gaudi3_cli, tmp_path / "plain", PLAIN, "aws") / "terraform" / "variables.tf"
    assert _default(hcl2, plain, "data_buckets") == {}


@pytest.mark.parametrize("accelerator", ["h100", "gaudi3"])
def test_the_dockerfile_run_example_passes_the_gpus_on_cuda(
    gaudi3_cli: Cli, tmp_path: Path, accelerator: str
) -> None:
    dockerfile = (
        _render(gaudi3_cli, tmp_path, PLAIN, "k8s", accelerator) / "docker" / "Dockerfile"
    ).read_text()
    (train_run,) = [
        line for line in dockerfile.splitlines() if line.startswith("#   docker run") and "runs:" in line
    ]
    assert ("--gpus all" in train_run) is (accelerator == "h100")
    if accelerator == "gaudi3":  # the Gaudi run line's sys_nice is explained (#19)
        assert "sys_nice (Habana's example) has no effect" in dockerfile
