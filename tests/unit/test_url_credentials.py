"""Issue 36, item 2: no config value carries credentials in a URL (`scheme://user:password@host`).

The resolved run config is written next to the run's outputs, logged to each tracker and rendered into deployment
files (Terraform user data, `docker/run.yaml`, `ansible/files/run.yaml`, the Kubernetes ConfigMap): a password in
any URL field, wherever it is nested (`data.mixture` entries included), is refused with one line by the one check
`config.urls.check_no_credentials` where config values are read, so `deploy render` (every target), `train` and
`prepare` all refuse it, write nothing and never print the password. URLs without credentials still render.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.config.urls import check_no_credentials
from render_targets import TARGET_FLAGS

Cli = Callable[..., tuple[int, str, str]]
PASSWORD = "S3cretPassw0rd"
TOKEN = "ghp0123456789abcdefTOKEN"  # a token passed as the user name, no password
BASE: dict[str, Any] = {
    "name": "creds",
    "model": {"name": "shakespeare-char", "num_layers": 1},
    "train": {"max_steps": 10, "global_batch_size": 32},
}
# Every URL-valued field of the run config, as (dotted field, where it goes in the YAML, a URL it takes).
URL_FIELDS: dict[str, tuple[tuple[str | int, ...], str]] = {
    "checkpoint.remote_url": (("checkpoint", "remote_url"), "https://store.example.com/ck"),
    "monitor.mlflow_tracking_uri": (("monitor", "mlflow_tracking_uri"), "https://mlflow.example.com/"),
    "data.source": (("data", "source"), "s3://datasets/web"),
    "data.mixture[1].source": (("data", "mixture", 1, "source"), "s3://datasets/code"),
    "data.prepared_dir": (("data", "prepared_dir"), "gs://datasets/prepared"),
    "train.spot_url": (("train", "spot_url"), "http://169.254.169.254/latest/meta-data/spot/instance-action"),
    "cost.spot_endpoint_url": (("cost", "spot_endpoint_url"), "https://pricing.example.com/api"),
}


def _with_credentials(url: str, userinfo: str = f"user:{PASSWORD}") -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{userinfo}@{rest}"


def _config(tmp_path: Path, urls: dict[str, str]) -> Path:
    """A run config with each field of `urls` set (a mixture gets a plain first member)."""
    config: dict[str, Any] = yaml.safe_load(yaml.safe_dump(BASE))
    for field, url in urls.items():
        where, _ = URL_FIELDS[field]
        node: Any = config
        for key in where[:-1]:
            if key == "mixture":
                node = node.setdefault("mixture", [{"source": "synthetic:256", "weight": 1}, {"weight": 1}])
            else:
                node = node.setdefault(key, {}) if isinstance(key, str) else node[key]
        node[where[-1]] = url
        if field == "cost.spot_endpoint_url":  # a spot price API's setting applies only with spot pricing
            node.update(pricing="spot", instance="aws/p5.48xlarge/us-east-1")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _render(cli: Cli, target: str, config: Path, out: Path) -> tuple[int, str, str]:
    return cli(
        "deploy",
        "render",
        "--target",
        target,
        *TARGET_FLAGS[target],
        "--config",
        str(config),
        "--out",
        str(out),
    )


def _one_line_refusal(code: int, out: str, err: str, field: str) -> None:
    assert code == 2, (code, out, err)
    # `deploy render` names the config file and the deployment's geometry first ("run.yaml on 2 node(s) × 8 per
    # node: "), the other commands name the field at once
    assert re.match(rf"gaudi3: error: (\S+ on \d+ node\(s\) × \d+ per node: )?{re.escape(field)}: ", err), err
    assert err.count("\n") == 1, err
    assert "credentials" in err and "environment" in err and "secret" in err, err
    assert PASSWORD not in out + err and TOKEN not in out + err


@pytest.mark.parametrize("field", URL_FIELDS)
@pytest.mark.parametrize("target", TARGET_FLAGS)
def test_render_refuses_a_password_in_any_url_field(
    gaudi3_cli: Cli, tmp_path: Path, target: str, field: str
) -> None:
    url = URL_FIELDS[field][1]
    clean, out_dir = tmp_path / "clean", tmp_path / "out"
    clean.mkdir()
    code, out, err = _render(gaudi3_cli, target, _config(clean, {field: url}), clean / "out")
    if field == "cost.spot_endpoint_url" and target in ("aws", "azure", "gcp"):
        # a cloud target rents on-demand instances: spot pricing is refused there (test_deploy_specs.py)
        assert code == 2 and "cost." in err, err
    else:
        assert code == 0, (
            err
        )  # without credentials the URL renders (the run config travels with every target)
        assert url in "".join(p.read_text() for p in (clean / "out").rglob("*") if p.is_file())
    code, out, err = _render(gaudi3_cli, target, _config(tmp_path, {field: _with_credentials(url)}), out_dir)
    _one_line_refusal(code, out, err, field)
    assert not out_dir.exists()  # nothing written, so the password is in no rendered file


def test_a_token_as_user_name_is_refused_too(gaudi3_cli: Cli, tmp_path: Path) -> None:
    url = _with_credentials("https://huggingface.co/datasets/x", userinfo=TOKEN)
    config = _config(tmp_path, {"data.mixture[1].source": url})
    code, out, err = _render(gaudi3_cli, "k8s", config, tmp_path / "out")
    _one_line_refusal(code, out, err, "data.mixture[1].source")


def test_train_and_prepare_refuse_credentials_and_write_nothing(gaudi3_cli: Cli, tmp_path: Path) -> None:
    url = _with_credentials("https://store.example.com/ck")
    code, out, err = gaudi3_cli("train", "--print-config", "--checkpoint.remote_url", url)
    _one_line_refusal(code, out, err, "checkpoint.remote_url")
    code, out, err = gaudi3_cli(
        "train", "--print-config", "--model.init_from", _with_credentials("https://hf.co/x")
    )
    _one_line_refusal(code, out, err, "model.init_from")
    config = _config(
        tmp_path, {"monitor.mlflow_tracking_uri": _with_credentials("https://mlflow.example.com")}
    )
    code, out, err = gaudi3_cli("prepare", _with_credentials("https://corpus.example.com/a.txt"), "--out",
                                str(tmp_path / "prepared"))  # fmt: skip
    _one_line_refusal(code, out, err, "SOURCES")  # the argument typed, not the config field behind it
    assert not (tmp_path / "prepared").exists()
    # `gaudi3 train` as users run it: no run directory (which would hold config.yaml) is created.
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "train", "--config", str(config),
                           "--out", str(run)], capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    _one_line_refusal(done.returncode, done.stdout, done.stderr, "monitor.mlflow_tracking_uri")
    assert not run.exists()


@pytest.mark.parametrize(
    "value",
    [
        "s3://bucket/prefix",
        "https://mlflow.example.com:5000/x?a=b@c",  # '@' in the query, not before the host
        "hf://datasets/org/name@main/data",  # '@' in the path (a revision)
        "abfs://container@account.dfs.core.windows.net/path",  # Azure's container@account form names no user
        "az://container@account.blob.core.windows.net/path",
        "user@example.com",  # not a URL
        "runs/a@b",
    ],
)
def test_what_is_not_a_credential_passes(value: str) -> None:
    check_no_credentials("f", value)


@pytest.mark.parametrize(
    "value",
    [
        f"https://user:{PASSWORD}@store.example.com/ck",
        f"s3://key:{PASSWORD}@bucket/x",
        f"postgresql://mlflow:{PASSWORD}@db:5432/mlflow",
        f"https://{TOKEN}@huggingface.co/x",
        f"abfs://container:{PASSWORD}@account.dfs.core.windows.net/x",  # a colon: a password, even on Azure
        f"synthetic,https://user:{PASSWORD}@corpus.example.com/a.txt",  # a URL inside a comma-separated list
        f"a://x,b://user:{PASSWORD}@host/y",
    ],
)
def test_credentials_are_refused_without_echoing_them(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^f: .*credentials") as caught:
        check_no_credentials("f", value)
    assert PASSWORD not in str(caught.value) and TOKEN not in str(caught.value)


def test_render_refuses_a_run_config_that_never_went_through_the_cli(tmp_path: Path) -> None:
    # `deploy.render` validates the run config it is given again (deploy.node_command), for every target.
    from gaudi3_scale.config.core import to_dict
    from gaudi3_scale.deploy.render import render
    from gaudi3_scale.deploy.spec import DeploySpec
    from gaudi3_scale.train.config import resolve_config

    config = _config(tmp_path, {})
    run_config = to_dict(resolve_config(str(config), []))
    run_config["data"]["mixture"] = [
        {"source": _with_credentials("https://corpus.example.com/x"), "weight": 1}
    ]
    for target in ("aws", "k8s"):
        spec = DeploySpec(target=target, accelerator="h100", nodes=2, per_node=8, config_path=config,
                          run_config=run_config, name="creds", image="registry.example/t:1")  # fmt: skip
        with pytest.raises(UserInputError, match=r"data\.mixture\[0\]\.source: .*credentials") as caught:
            render(spec)
        assert PASSWORD not in str(caught.value)
