"""The rendered image and permissions reach every storage URL the nodes open: the checkpoint bucket a cloud target
creates (every node gets it as --checkpoint.remote_url) and the run config's own data and model URLs.

Which package serves a scheme is fsspec's own table (`fsspec.registry.known_implementations`); which packages an
image holds is pyproject.toml's extras named by the Dockerfile's `ARG EXTRAS`, as its base stage reads them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from fsspec.registry import known_implementations

from gaudi3_scale.deploy.containers import SCHEME_EXTRAS, image_extras

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
    return _extras_modules([e for e in extras.split(",") if e])


def _extras_modules(extras: list[str]) -> set[str]:
    """The top-level modules the base dependencies and `extras` install (pyproject.toml)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    requirements = [*project["dependencies"], *(r for e in extras for r in optional[e])]
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


# adlfs adds abfss:// to fsspec's table when imported (AzureBlobFileSystem.protocol); fsspec's own table lacks it
_REGISTERED_ON_IMPORT = {"abfss": "adlfs"}
# backends a base dependency brings: lightning requires fsspec, tokenizers huggingface_hub (checked below)
_VIA_BASE = {"fsspec": "lightning", "huggingface_hub": "tokenizers"}


@pytest.mark.parametrize("scheme", sorted(SCHEME_EXTRAS))
def test_every_scheme_the_image_serves_brings_its_backend(scheme: str) -> None:
    """Each scheme of the table renders, and the extras it adds install the module fsspec opens it with."""
    run_config = {"data": {"source": f"{scheme}://bucket/corpus"}}
    module = _REGISTERED_ON_IMPORT.get(scheme) or _backend_module(f"{scheme}://")
    assert module.split(".")[0] in _extras_modules(image_extras(run_config, "h100")) | set(_VIA_BASE)


def test_hf_urls_need_no_extra_as_tokenizers_brings_huggingface_hub() -> None:
    """huggingface_hub is installed with the base dependencies (tokenizers requires it), and it serves hf://."""
    from importlib.metadata import requires

    from fsspec import get_filesystem_class

    for module, base in _VIA_BASE.items():
        assert base in _extras_modules([])
        assert module in {re.split(r"[<>=!~\[; ]", r)[0].replace("-", "_") for r in requires(base) or []}
    assert get_filesystem_class("hf").__module__.startswith("huggingface_hub")
    assert SCHEME_EXTRAS["hf"] is None


@pytest.mark.parametrize(
    ("url", "extra"),
    [("abfss://ckpts@acct.dfs.core.windows.net/run", "azure"), ("hf://datasets/acme/corpus", None)],
)
def test_abfss_and_hf_urls_render(gaudi3_cli: Cli, tmp_path: Path, url: str, extra: str | None) -> None:
    out = _render(gaudi3_cli, tmp_path, PLAIN + f"checkpoint: {{remote_url: '{url}'}}\n", "k8s")
    (extras,) = re.findall(r"^ARG EXTRAS=(.*)$", (out / "docker" / "Dockerfile").read_text(), re.M)
    assert extra is None or extra in extras.split(",")


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
        # optional: only data needs it, and pods that read it through workload identity must start without it
        assert container["envFrom"] == [
            {"secretRef": {"name": "s3-data-checkpoint-credentials", "optional": True}}
        ]
    readme = (tmp_path / "s3" / "out-k8s" / "k8s" / "README.md").read_text()
    assert "The Secret is optional here" in readme
    plain = yaml.safe_load(
        (_render(gaudi3_cli, tmp_path / "plain", PLAIN, "k8s") / "k8s" / "pytorchjob.yaml").read_text()
    )
    assert (
        "envFrom" not in plain["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    )


def test_the_credentials_secret_of_a_checkpoint_mirror_is_required(gaudi3_cli: Cli, tmp_path: Path) -> None:
    text = S3_DATA + "checkpoint: {remote_url: 's3://ckpt-bucket/run'}\n"
    out = _render(gaudi3_cli, tmp_path, text, "k8s") / "k8s"
    job = yaml.safe_load((out / "pytorchjob.yaml").read_text())
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        assert container["envFrom"] == [{"secretRef": {"name": "s3-data-checkpoint-credentials"}}]
    assert "optional" not in (out / "README.md").read_text().split("come from the Secret")[1].split("```")[0]


def _unquoted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k.strip('"'): _unquoted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unquoted(v) for v in value]
    return value.strip('"') if isinstance(value, str) else value


def _default(hcl2: Any, variables_tf: Path, name: str) -> Any:
    """A variable's default as python-hcl2 reads it, string quotes off."""
    with open(variables_tf) as f:
        blocks = {k.strip('"'): v for block in hcl2.load(f)["variable"] for k, v in block.items()}
    return _unquoted(blocks[name]["default"])


# one bucket read under two prefixes (one listed with another bucket), and a whole bucket
S3_PREFIXES = """\
name: s3-prefixes
model: {num_layers: 1}
train: {global_batch_size: 96, max_steps: 5}
data:
  mixture:
    - {source: s3://shared-bucket/team-a/corpus, weight: 1}
    - {source: "s3://shared-bucket/team-a/code,s3://other/x", weight: 1}
    - {source: s3://whole, weight: 1}
"""


def _terraform_console(terraform: Path, tmp_path: Path, expression: str) -> Any:
    """`expression` evaluated by terraform console against the rendered variables' defaults."""
    work = tmp_path / "console"
    work.mkdir(parents=True)
    shutil.copy(terraform / "variables.tf", work)
    (work / "locals.tf").write_text('locals { partition = "aws" }\n')
    done = subprocess.run(["terraform", "console"], input=f"jsonencode({expression})\n", cwd=work,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(json.loads(done.stdout))


def test_the_aws_instance_role_may_read_only_the_data_prefixes(gaudi3_cli: Cli, tmp_path: Path) -> None:
    hcl2 = pytest.importorskip("hcl2")
    terraform = _render(gaudi3_cli, tmp_path, S3_PREFIXES, "aws") / "terraform"
    buckets = {"other": ["x"], "shared-bucket": ["team-a/code", "team-a/corpus"], "whole": [""]}
    assert _default(hcl2, terraform / "variables.tf", "data_buckets") == buckets
    main_tf = (terraform / "main.tf").read_text()
    (read,) = re.findall(r'sid       = "ReadData"\n.*\n\s*resources = (.*)\n', main_tf)
    (list_values,) = re.findall(r'variable = "s3:prefix"\n\s*values   = (.*)\n', main_tf)
    assert '"s3:GetObject"' in main_tf[main_tf.index('"ReadData"') :][:100]
    assert "for_each = var.data_buckets" in main_tf and ':::${statement.key}"' in main_tf
    if shutil.which("terraform") is None:
        return
    assert _terraform_console(terraform, tmp_path, read) == [
        "arn:aws:s3:::other/x*",
        "arn:aws:s3:::shared-bucket/team-a/code*",
        "arn:aws:s3:::shared-bucket/team-a/corpus*",
        "arn:aws:s3:::whole/*",
    ]
    shared = list_values.replace("statement.value", 'var.data_buckets["shared-bucket"]')
    assert _terraform_console(terraform, tmp_path / "s", shared) == ["team-a/code*", "team-a/corpus*"]


def test_a_config_without_s3_data_grants_no_data_bucket(gaudi3_cli: Cli, tmp_path: Path) -> None:
    hcl2 = pytest.importorskip("hcl2")
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
