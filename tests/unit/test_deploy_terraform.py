"""`gaudi3 deploy render --target aws|azure|gcp|onprem`: Terraform and Ansible, validated offline.

Every rendered `.tf` file is parsed (python-hcl2) and its structure asserted; checkov scans each cloud's files once
and may fail only the checks listed, with a reason, in src/gaudi3_scale/deploy/checkov_baseline.yaml; the node
bootstrap is filled in the way Terraform's templatefile() does (and by Terraform itself where its binary is
installed), then its scripts are run against fake `docker` / `aws` commands. Golden copies of each target's files
(its terraform/ or ansible/ directory) live in tests/golden/deploy/<target>/: after a deliberate change, regenerate
them with `GAUDI3_UPDATE_GOLDEN=1 pytest tests/unit/test_deploy_terraform.py` and review the diff.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import hcl2
import jinja2
import pytest
import yaml

from deploy_readers import templatefile
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.deploy import tf_common
from gaudi3_scale.deploy.quoting import hcl_string
from gaudi3_scale.deploy.render import renderers
from gaudi3_scale.deploy.spec import DeploySpec, default_per_node
from gaudi3_scale.deploy.terraform import instance_for
from gaudi3_scale.train.config import build_run_config, config_dict, resolve_config

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "deploy"
UPDATE = os.environ.get("GAUDI3_UPDATE_GOLDEN") == "1"  # rewrite the golden files after a deliberate change
BASELINE = yaml.safe_load((ROOT / "src/gaudi3_scale/deploy/checkov_baseline.yaml").read_text())
IMAGE = "registry.example.com/gaudi3-scale-train:golden-cuda"
# A resolved run config (each renderer checks it with its nodes' command): DDP with a remote mirror, which nodes on
# their own disks can resume from.
RUN_CONFIG = config_dict(build_run_config(None, [
    ("name", "golden"), ("model.name", "shakespeare-char"), ("model.num_layers", 1),
    ("train.global_batch_size", 384), ("train.micro_batch_size", 8), ("train.max_steps", 10),
    ("parallel.strategy", "ddp"), ("checkpoint.remote_url", "s3://golden-bucket/golden"),
]))  # fmt: skip
HOSTS = ("gpu-a.lab", "gpu-b.lab", "10.1.2.3")
CLOUDS = ("aws", "azure", "gcp")
TARGETS = (*CLOUDS, "onprem")


def _spec(target: str, accelerator: str = "h100", **overrides: Any) -> DeploySpec:
    fields: dict[str, Any] = dict(target=target, accelerator=accelerator, nodes=2, per_node=8,
                                  config_path=Path("run.yaml"), run_config=RUN_CONFIG, name="golden", image=IMAGE)  # fmt: skip
    if target == "onprem":
        fields.update(accelerator="gaudi3", nodes=len(HOSTS), hosts=HOSTS,
                      image="registry.example.com/gaudi3-scale-train:golden-gaudi")  # fmt: skip
    fields.update(overrides)
    return DeploySpec(**fields)


def _render(spec: DeploySpec) -> dict[str, str]:
    """The target's files, relative to their directory under --out (terraform/ or ansible/)."""
    files = renderers()[spec.target](spec)
    prefix = "ansible/" if spec.target == "onprem" else "terraform/"
    assert all(rel.startswith(prefix) for rel in files), sorted(files)
    return {rel.removeprefix(prefix): text for rel, text in files.items()}


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, str]]:
    return {target: _render(_spec(target)) for target in TARGETS}


def _plain(value: Any) -> Any:
    """python-hcl2's tree without its bookkeeping: quotes off string literals and labels, no `__…__` keys."""
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items() if not k.startswith("__")}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def _hcl(files: dict[str, str], name: str) -> dict[str, Any]:
    return _plain(hcl2.loads(files[name]))


def _blocks(tree: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    """{"type.name": body} of the resource / data blocks of a parsed file."""
    return {
        f"{t}.{n}": body
        for block in tree.get(kind, [])
        for t, named in block.items()
        for n, body in named.items()
    }


def _variables(files: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {k: v for block in _hcl(files, "variables.tf")["variable"] for k, v in block.items()}


# ---- golden files -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_rendered_files_match_the_golden_copies(target: str, rendered: dict[str, dict[str, str]]) -> None:
    files = rendered[target]
    directory = GOLDEN / target
    if UPDATE:
        shutil.rmtree(directory, ignore_errors=True)
        for rel, text in files.items():
            (directory / rel).parent.mkdir(parents=True, exist_ok=True)
            (directory / rel).write_text(text)
    on_disk = {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}
    assert on_disk == set(files), "regenerate with GAUDI3_UPDATE_GOLDEN=1 (see the module docstring)"
    for rel, text in files.items():
        assert (directory / rel).read_text() == text, f"{target}/{rel} differs from its golden copy"


# ---- structure of the Terraform ---------------------------------------------------------------------------------


@pytest.mark.parametrize("target", CLOUDS)
def test_every_tf_file_parses_and_declares_what_the_nodes_need(
    target: str, rendered: dict[str, dict[str, str]]
) -> None:
    files = rendered[target]
    assert {"main.tf", "variables.tf", "outputs.tf", "versions.tf", tf_common.BOOTSTRAP} <= set(files)
    trees = {name: _hcl(files, name) for name in files if name.endswith(".tf")}
    versions = trees["versions.tf"]["terraform"][0]
    assert versions["required_version"] == ">= 1.5"
    (providers,) = versions["required_providers"]
    assert all(p["version"].startswith("~> ") for p in providers.values())  # pinned to one major version
    outputs = {k for block in trees["outputs.tf"]["output"] for k in block}
    assert {"node_private_ips", "master_address", "checkpoint_url"} <= outputs
    variables = _variables(files)
    assert variables["nodes"]["default"] == 2 and variables["nproc_per_node"]["default"] == 8
    assert variables["image"]["default"] == IMAGE
    assert variables["ssh_allowed_cidr"]["default"] is None  # no SSH unless asked for
    assert variables["secrets"]["default"] == {}
    # Nothing secret has a value in the files: secret-ish variables have no default, or null / empty.
    for name, body in variables.items():
        if re.search(r"key|secret|password|token", name):
            assert body.get("default") in (None, {}), name
    assert 'templatefile("${path.module}/bootstrap.sh.tftpl"' in files["main.tf"]


def test_aws_cluster_placement_efa_private_encrypted_bucket_and_narrow_rules(
    rendered: dict[str, dict[str, str]],
) -> None:
    files = rendered["aws"]
    res = _blocks(_hcl(files, "main.tf"), "resource")
    assert res["aws_placement_group.nodes"]["strategy"] == "cluster"
    node = res["aws_instance.nodes"]
    assert node["placement_group"] == "${aws_placement_group.nodes.id}"
    assert node["metadata_options"][0]["http_tokens"] == "required"
    assert node["root_block_device"][0]["encrypted"] is True
    assert res["aws_network_interface.nodes"]["interface_type"] == '${var.efa ? "efa" : null}'
    variables = _variables(files)
    assert variables["efa"]["default"] is True and variables["instance_type"]["default"] == "p5.48xlarge"
    assert "default" not in variables["ami_id"] and "default" not in variables["subnet_id"]
    assert variables["region"]["default"] == "us-east-1"
    # the bucket: versioned, KMS-encrypted, no public access, TLS only
    assert res["aws_s3_bucket_versioning.checkpoints"]["versioning_configuration"][0]["status"] == "Enabled"
    sse = res["aws_s3_bucket_server_side_encryption_configuration.checkpoints"]["rule"][0]
    assert sse["apply_server_side_encryption_by_default"][0]["sse_algorithm"] == "aws:kms"
    block = res["aws_s3_bucket_public_access_block.checkpoints"]
    assert all(block[k] is True for k in ("block_public_acls", "block_public_policy", "ignore_public_acls",
                                          "restrict_public_buckets"))  # fmt: skip
    # the rules: every node reaches every node; HTTPS out; SSH only from the variable, and only when it is set
    ingress = {k: v for k, v in res.items() if k.startswith("aws_vpc_security_group_ingress_rule.")}
    egress = {k: v for k, v in res.items() if k.startswith("aws_vpc_security_group_egress_rule.")}
    assert set(ingress) == {
        "aws_vpc_security_group_ingress_rule.between_nodes",
        "aws_vpc_security_group_ingress_rule.ssh",
    }
    assert ingress["aws_vpc_security_group_ingress_rule.between_nodes"]["referenced_security_group_id"] == (
        "${aws_security_group.nodes.id}"
    )
    ssh = ingress["aws_vpc_security_group_ingress_rule.ssh"]
    assert (
        ssh["count"] == "${var.ssh_allowed_cidr == null ? 0 : 1}"
        and ssh["cidr_ipv4"] == "${var.ssh_allowed_cidr}"
    )
    assert (ssh["from_port"], ssh["to_port"]) == (22, 22)
    assert {(r.get("from_port"), r.get("cidr_ipv4")) for r in egress.values()} == {
        (None, None),  # to the group itself
        (443, "0.0.0.0/0"),
    }
    # least privilege: the role's statements name only the checkpoint bucket (and the named SSM parameters / key)
    data = _blocks(_hcl(files, "main.tf"), "data")
    statements = data["aws_iam_policy_document.nodes"]["statement"]
    assert {tuple(s["resources"]) for s in statements} == {
        ("${aws_s3_bucket.checkpoints.arn}",),
        ("${aws_s3_bucket.checkpoints.arn}/*",),
    }
    assert not any("*" in a for s in statements for a in s["actions"])


def test_azure_proximity_group_private_versioned_storage_and_identity(
    rendered: dict[str, dict[str, str]],
) -> None:
    files = rendered["azure"]
    res = _blocks(_hcl(files, "main.tf"), "resource")
    vm = res["azurerm_linux_virtual_machine.nodes"]
    assert vm["proximity_placement_group_id"] == "${azurerm_proximity_placement_group.nodes.id}"
    assert vm["disable_password_authentication"] is True and vm["identity"][0]["type"] == "UserAssigned"
    account = res["azurerm_storage_account.checkpoints"]
    assert account["blob_properties"][0]["versioning_enabled"] is True
    assert (
        account["shared_access_key_enabled"] is False and account["allow_nested_items_to_be_public"] is False
    )
    assert account["infrastructure_encryption_enabled"] is True and account["min_tls_version"] == "TLS1_2"
    assert account["network_rules"][0]["default_action"] == "Deny"
    assert res["azurerm_storage_container.checkpoints"]["container_access_type"] == "private"
    role = res["azurerm_role_assignment.checkpoints"]
    assert role["role_definition_name"] == "Storage Blob Data Contributor"
    assert "/blobServices/default/containers/" in role["scope"]  # the container, not the account
    rules = {k: v for k, v in res.items() if k.startswith("azurerm_network_security_rule.")}
    assert rules["azurerm_network_security_rule.between_nodes"]["source_application_security_group_ids"] == [
        "${azurerm_application_security_group.nodes.id}"
    ]
    assert rules["azurerm_network_security_rule.ssh"]["source_address_prefix"] == "${var.ssh_allowed_cidr}"
    assert rules["azurerm_network_security_rule.deny_rest_of_vnet"]["access"] == "Deny"
    variables = _variables(files)
    assert variables["instance_type"]["default"] == "Standard_ND96isr_H100_v5"
    assert "default" not in variables["location"]  # the catalog knows no region for Azure: Terraform asks


def test_gcp_compact_placement_private_bucket_and_service_account_rules(
    rendered: dict[str, dict[str, str]],
) -> None:
    files = rendered["gcp"]
    res = _blocks(_hcl(files, "main.tf"), "resource")
    policy = res["google_compute_resource_policy.placement"]["group_placement_policy"][0]
    assert policy["collocation"] == "COLLOCATED"
    node = res["google_compute_instance.nodes"]
    assert node["resource_policies"] == ["${google_compute_resource_policy.placement.id}"]
    assert "access_config" not in node["network_interface"][0]  # no public address
    assert node["scheduling"][0]["on_host_maintenance"] == "TERMINATE"
    bucket = res["google_storage_bucket.checkpoints"]
    assert bucket["versioning"][0]["enabled"] is True and bucket["public_access_prevention"] == "enforced"
    assert bucket["uniform_bucket_level_access"] is True
    member = res["google_storage_bucket_iam_member.checkpoints"]
    assert member["bucket"] == "${google_storage_bucket.checkpoints.name}"
    assert member["role"] == "roles/storage.objectUser"
    between = res["google_compute_firewall.between_nodes"]
    assert between["source_service_accounts"] == between["target_service_accounts"]
    assert "source_ranges" not in between
    assert res["google_compute_firewall.ssh"]["source_ranges"] == ["${var.ssh_allowed_cidr}"]
    assert _variables(files)["instance_type"]["default"] == "a3-highgpu-8g"


def test_a_run_config_too_big_for_ec2_user_data_is_one_line() -> None:
    with pytest.raises(UserInputError, match=r"EC2 user data holds 16,384"):
        big = {**RUN_CONFIG, "data": {**RUN_CONFIG["data"], "source": "/data/" + "x" * 16_000}}
        _render(_spec("aws", run_config=big))


def test_gcp_takes_a_zone_as_its_region() -> None:
    files = _render(_spec("gcp", region="europe-west4-b"))
    assert _variables(files)["zone"]["default"] == "europe-west4-b"
    with pytest.raises(UserInputError, match=r"gcp needs a zone such as us-central1-a"):
        _render(_spec("gcp", region="us-central1"))


# ---- the node bootstrap -----------------------------------------------------------------------------------------


def _template_values(target: str) -> dict[str, Any]:
    values = dict(node_rank=1, rdzv_host="10.0.0.5", nnodes=2, nproc_per_node=8, image="img:1",
                  checkpoint_url="s3://bucket/golden", secrets={"HF_TOKEN": "/gaudi3/hf", "WANDB_API_KEY": "wb"})  # fmt: skip
    extra = {
        "aws": {"region": "us-east-1"},
        "azure": {"storage_account": "goldenacct", "client_id": "cid", "key_vault_name": "kv"},
        "gcp": {"project": "proj"},
    }
    return {**values, **extra[target]}


def _heredocs(script: str) -> dict[str, str]:
    return dict(re.findall(r"cat > (\S+) <<'GAUDI3_EOF'\n(.*?)GAUDI3_EOF\n", script, re.S))


def _env_file(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def _fake_command(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


@pytest.mark.parametrize("target", CLOUDS)
def test_the_bootstrap_starts_the_launcher_with_this_nodes_rank(
    target: str, rendered: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    script = templatefile(rendered[target][tf_common.BOOTSTRAP], _template_values(target))
    subprocess.run(["bash", "-n", "-c", script], check=True)
    files = _heredocs(script)
    assert yaml.safe_load(files["/etc/gaudi3/run.yaml"]) == _spec(target).run_config  # with the device pinned
    assert files["/etc/gaudi3/secret-refs"] == "HF_TOKEN=/gaudi3/hf\nWANDB_API_KEY=wb\n"
    unit = files["/etc/systemd/system/gaudi3-train.service"]
    assert "ExecStartPre=/usr/local/bin/gaudi3-secrets" in unit and "RestartPreventExitStatus=2 3 4" in unit
    for path in ("/usr/local/bin/gaudi3-secrets", "/usr/local/bin/gaudi3-node"):
        subprocess.run(["bash", "-n", "-c", files[path]], check=True)
    # Run the node script for real, with a `docker` that records its arguments.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_command(bin_dir, "docker", 'printf "%s\\n" "$@" > "$ARGS_OUT"\n')
    env = {**_env_file(files["/etc/gaudi3/node.env"]), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "ARGS_OUT": str(tmp_path / "args")}  # fmt: skip
    subprocess.run(["bash", "-c", files["/usr/local/bin/gaudi3-node"]], env=env, check=True)
    argv = (tmp_path / "args").read_text().splitlines()
    assert argv[0] == "run" and "--gpus" in argv and argv[argv.index("--network") + 1] == "host"
    assert argv[argv.index("img:1") - 2 : argv.index("img:1")] == ["--entrypoint", "gaudi3"]
    node_args = argv[argv.index("img:1") + 1 :]
    assert node_args == [
        "train", "--config", "/etc/gaudi3/run.yaml", "--out", "/workspace/runs/golden", "--no-progress",
        "--sample-tokens", "0", "--parallel.nnodes=2", "--parallel.nproc_per_node=8", "--parallel.node_rank=1",
        "--parallel.rdzv_endpoint=10.0.0.5:29500", "--checkpoint.remote_url=s3://bucket/golden",
    ]  # fmt: skip
    # What the node's `gaudi3 train` makes of it: the project's own loader, on the rendered run.yaml.
    (tmp_path / "run.yaml").write_text(files["/etc/gaudi3/run.yaml"])
    cfg = resolve_config(str(tmp_path / "run.yaml"), node_args[8:], out_dir=node_args[4])
    assert (cfg.parallel.nnodes, cfg.parallel.nproc_per_node, cfg.parallel.node_rank) == (2, 8, 1)
    assert (
        cfg.parallel.rdzv_endpoint == "10.0.0.5:29500" and cfg.checkpoint.remote_url == "s3://bucket/golden"
    )
    assert str(cfg.out_dir) == "/workspace/runs/golden"  # on the mounted /var/lib/gaudi3, not the container
    passed = {argv[i + 1] for i, a in enumerate(argv) if a == "-e"}
    assert passed == set(env["PASS_ENV"].split()) and "HF_TOKEN" not in passed  # secrets only via --env-file


def test_the_aws_secrets_script_writes_a_private_env_file(
    rendered: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    script = templatefile(rendered["aws"][tf_common.BOOTSTRAP], _template_values("aws"))
    files = _heredocs(script)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "secret-refs").write_text(files["/etc/gaudi3/secret-refs"])
    fetcher = files["/usr/local/bin/gaudi3-secrets"].replace("/etc/gaudi3/", f"{tmp_path}/etc/")
    fetcher = fetcher.replace("/run/gaudi3", f"{tmp_path}/run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_command(
        bin_dir, "aws", 'while [ $# -gt 0 ]; do [ "$1" = --name ] && echo "value of $2"; shift; done\n'
    )
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "AWS_DEFAULT_REGION": "us-east-1"}
    subprocess.run(["bash", "-c", fetcher], env=env, check=True)
    out = tmp_path / "run" / "secrets.env"
    assert out.read_text() == "HF_TOKEN=value of /gaudi3/hf\nWANDB_API_KEY=value of wb\n"
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def _hcl_literal(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_hcl_literal(v)}" for k, v in value.items()) + " }"
    return str(value) if isinstance(value, int) else hcl_string(str(value))


@pytest.mark.skipif(
    shutil.which("terraform") is None, reason="terraform is not installed (not on PyPI / Debian)"
)
def test_terraform_itself_fills_in_the_bootstrap_the_same_way(
    rendered: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    (tmp_path / "t.tftpl").write_text(rendered["azure"][tf_common.BOOTSTRAP])
    values = _template_values("azure")
    hcl_values = ", ".join(f"{k} = {_hcl_literal(v)}" for k, v in values.items())
    done = subprocess.run(
        ["terraform", "console"], input=f'templatefile("t.tftpl", {{ {hcl_values} }})\n', cwd=tmp_path,
        capture_output=True, text=True, timeout=60, env={**os.environ, "TF_CLI_CONFIG_FILE": os.devnull},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    body = re.search(r"<<EOT\n(.*)\nEOT", done.stdout, re.S)
    assert body is not None, done.stdout[:500]
    assert body.group(1).rstrip() == templatefile(rendered["azure"][tf_common.BOOTSTRAP], values).rstrip()


# ---- checkov ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkov_reports(
    rendered: dict[str, dict[str, str]],
    checkov: Callable[..., dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Any]]:
    """One checkov run per cloud, side by side (each is a few seconds of one core). Not onprem: checkov's Ansible
    checks cover modules the playbook does not use, so it reports no resources at all there."""
    directories = {}
    for target in CLOUDS:
        files = rendered[target]
        directory = tmp_path_factory.mktemp(f"checkov-{target}")
        for rel, text in files.items():
            (directory / rel).parent.mkdir(parents=True, exist_ok=True)
            (directory / rel).write_text(text)
        directories[target] = directory
    with ThreadPoolExecutor(len(directories)) as pool:
        futures = {t: pool.submit(checkov, d, framework="terraform") for t, d in directories.items()}
        return {t: f.result() for t, f in futures.items()}


@pytest.mark.parametrize("target", CLOUDS)
def test_checkov_fails_only_the_checks_in_the_baseline(
    target: str, checkov_reports: dict[str, dict[str, Any]]
) -> None:
    report = checkov_reports[target]
    failed = {c["check_id"]: c["check_name"] for c in report["results"]["failed_checks"]}
    baseline = BASELINE.get(target) or {}
    assert all(isinstance(reason, str) and len(reason) > 20 for reason in baseline.values())  # each says why
    unexpected = {k: v for k, v in failed.items() if k not in baseline}
    assert not unexpected, (
        f"new checkov failures: fix them, or add them with a reason to the baseline: {unexpected}"
    )
    assert set(baseline) <= set(failed), (
        f"baseline entries that no longer fail: {set(baseline) - set(failed)}"
    )
    assert report["summary"]["passed"] >= 10  # the checks really ran


# ---- which instance, and the one-line refusals ------------------------------------------------------------------


def test_instance_for_picks_the_catalog_instance_with_the_most_accelerators() -> None:
    assert instance_for("aws", "h100").type == "p5.48xlarge"
    assert instance_for("aws", "a100").type == "p4de.24xlarge"  # 80 GB; p4d is the 40 GB part
    assert instance_for("azure", "h200").type == "Standard_ND96isr_H200_v5"
    assert instance_for("gcp", "h200").type == "a3-ultragpu-8g"
    assert default_per_node("aws", "h100") == 8 and default_per_node("onprem", "gaudi3") == 8


def test_azure_and_gcp_catalog_entries_invent_no_price_or_region() -> None:
    from gaudi3_scale.metering.catalog import load_instances

    entries = [i for i in load_instances().values() if i.provider in ("azure", "gcp")]
    assert {i.type for i in entries} >= {"Standard_ND96isr_H100_v5", "a3-highgpu-8g"}
    for i in entries:
        assert i.on_demand_usd_per_hour is None and i.spot_usd_per_hour_range is None, i.type
        assert i.region == tf_common.UNKNOWN_REGION and i.source, i.type


@pytest.mark.parametrize("target", CLOUDS)
def test_gaudi_on_a_cloud_is_one_line_listing_what_exists(target: str) -> None:
    with pytest.raises(UserInputError) as info:
        _render(_spec(target, accelerator="gaudi3"))
    message = str(info.value)
    assert "\n" not in message and f"{target} offers no gaudi3 instance in the catalog" in message
    assert "use --target onprem or k8s" in message
    if target == "aws":
        assert "p5.48xlarge (8 × h100-sxm)" in message and "p4de.24xlarge (8 × a100-sxm)" in message


def test_an_accelerator_another_cloud_has_is_named_there() -> None:
    with pytest.raises(UserInputError) as info:
        instance_for("gcp", "a100")
    message = str(info.value)
    assert "gcp instances that exist: a3-highgpu-8g (8 × h100-sxm), a3-ultragpu-8g (8 × h200-sxm)" in message
    assert "a100 is offered by aws p4de.24xlarge, azure Standard_ND96amsr_A100_v4" in message


def test_the_cli_refuses_gaudi_on_aws_with_exit_2(
    gaudi3_cli: Callable[..., tuple[int, str, str]], tmp_path: Path
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("name: golden\ntrain:\n  global_batch_size: 16\n")  # splits over 2 nodes × 8
    code, _, err = gaudi3_cli("deploy", "render", "--target", "aws", "--accelerator", "gaudi3", "--nodes", "2",
                              "--config", str(config), "--out", str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and "aws offers no gaudi3 instance" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = gaudi3_cli("deploy", "render", "--target", "onprem", "--accelerator", "gaudi3", "--nodes", "2",
                              "--config", str(config), "--out", str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and "--hosts: onprem needs the machines" in err and len(err.strip().splitlines()) == 1
    code, _, err = gaudi3_cli("deploy", "render", "--target", "aws", "--accelerator", "h100", "--nodes", "2",
                                "--config", str(config), "--out", str(tmp_path / "out"))  # fmt: skip
    assert code == 0, err
    code, _, err = gaudi3_cli("deploy", "render", "--target", "aws", "--accelerator", "h100", "--nodes", "3",
                              "--config", str(config), "--out", str(tmp_path / "out3"))  # fmt: skip
    assert (
        code == 2
        and (
            "3 node(s) × 8 per node: train.global_batch_size: 16 sequences are fewer than the 24 data-parallel ranks"
        )
        in err
    )
    assert not (tmp_path / "out3").exists()
    assert "p5.48xlarge" in (tmp_path / "out" / "terraform" / "variables.tf").read_text()


# ---- on-prem ----------------------------------------------------------------------------------------------------


def test_onprem_inventory_ranks_the_hosts_and_the_playbook_installs_the_node(
    rendered: dict[str, dict[str, str]],
) -> None:
    files = rendered["onprem"]
    inventory = yaml.safe_load(files["inventory.yaml"])["all"]["children"]["gaudi3_nodes"]
    assert [(h, v["node_rank"]) for h, v in inventory["hosts"].items()] == [
        (h, i) for i, h in enumerate(HOSTS)
    ]
    group = inventory["vars"]
    assert group["gaudi3_master_addr"] == HOSTS[0] and group["gaudi3_nnodes"] == 3
    (play,) = yaml.safe_load(files["playbook.yaml"])
    assert play["hosts"] == "gaudi3_nodes" and play["become"] is True
    sources = {t[m]["src"] for t in play["tasks"] for m in t if isinstance(t[m], dict) and "src" in t[m]}
    assert sources == {f for f in files if f.startswith(("files/", "templates/"))}
    # node.env as Ansible renders it for the second host
    env = jinja2.Template(files["templates/node.env.j2"]).render(
        node_rank=1, ansible_managed="managed", **group
    )
    values = _env_file(env)
    assert (values["NODE_RANK"], values["RDZV_HOST"], values["NNODES"]) == ("1", HOSTS[0], "3")
    assert values["SECRETS_ENV_FILE"] == "/etc/gaudi3/secrets.env" and values["CHECKPOINT_URL"] == ""
    assert "--runtime habana" in files["files/gaudi3-node"]  # Gaudi hosts: Intel's container runtime
    assert "gaudi3-secrets" not in files["files/gaudi3-train.service"]


@pytest.mark.parametrize(
    ("hosts", "message"),
    [
        ((), "--hosts: onprem needs the machines to train on"),
        (("a", "b"), "--hosts: 2 host(s) for --nodes 3"),
        (("a", "b", "a"), "--hosts: 'a' is listed twice"),
        (("a", "b c", "d"), "--hosts: each host must be a host name"),
    ],
)
def test_onprem_host_mistakes_are_one_line(hosts: tuple[str, ...], message: str) -> None:
    with pytest.raises(UserInputError) as info:
        _render(_spec("onprem", hosts=hosts))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_ipv6_master_is_bracketed_in_the_rendezvous_endpoint() -> None:
    files = _render(_spec("onprem", hosts=("fd00::1", "fd00::2"), nodes=2))
    group = yaml.safe_load(files["inventory.yaml"])["all"]["children"]["gaudi3_nodes"]["vars"]
    assert group["gaudi3_master_addr"] == "[fd00::1]"


def test_the_clouds_bucket_schemes_have_one_home() -> None:
    """The node command's check uses the bucket schemes spec.py declares (review s13 #11), not a copy."""
    from gaudi3_scale.deploy import spec, tf_common

    assert tf_common.BUCKET_SCHEMES is spec.BUCKET_SCHEMES
    assert not hasattr(tf_common, "_BUCKET_SCHEMES")
