"""How the consumers of rendered deployment files read them, re-stated for the deploy tests (tests/unit/test_deploy_*):
Terraform's templatefile() on the node bootstrap, RE2's whole-text match (Terraform's regex()), and Go's yaml.v2
(kubectl, sigs.k8s.io/yaml), which reads more plain scalars as booleans and numbers than PyYAML does."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "SECRETS_LOOP",
    "GoYamlLikeLoader",
    "node_train_argv",
    "re2_fullmatch",
    "resolve_node_argv",
    "templatefile",
]

SECRETS_LOOP = "%{ for env_name, ref in secrets ~}\n${env_name}=${ref}\n%{ endfor ~}\n"
_NOT_ESCAPED = re.compile(r"(?<!\$)\$\{|(?<!%)%\{")


def templatefile(text: str, values: dict[str, Any]) -> str:
    """What Terraform's templatefile() makes of the bootstrap: its one for-loop, `${name}` interpolations, and the
    `$${` / `%%{` escapes. Anything else in template syntax fails here (Terraform would need to evaluate it)."""
    text = text.replace(SECRETS_LOOP, "".join(f"{k}={v}\n" for k, v in sorted(values["secrets"].items())))
    text = re.sub(r"(?<!\$)\$\{([a-z_]+)\}", lambda m: str(values[m.group(1)]), text)
    assert not _NOT_ESCAPED.search(text), _NOT_ESCAPED.search(text)
    return text.replace("$${", "${").replace("%%{", "%{")


def re2_fullmatch(anchored: str, value: str) -> bool:
    """RE2's `^…$` (Terraform's regex()): `$` is the end of the text only, not also before a final newline as in
    Python's `re`; the grammars use no syntax the two engines read differently otherwise."""
    assert anchored.startswith("^") and anchored.endswith("$"), anchored
    return re.search(anchored[:-1] + r"\Z", value, re.ASCII) is not None


class GoYamlLikeLoader(yaml.SafeLoader):
    """PyYAML plus the plain scalars Go's yaml.v2 also reads as booleans or numbers: y / n, 1e3, 0o17."""


GoYamlLikeLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN"))
GoYamlLikeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)
GoYamlLikeLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?0o[0-7_]+$"), list("-+0"))


# ---- the node's `gaudi3 train` command, as each target's node really gets it -------------------------------------

# What Terraform fills into a cloud node's bootstrap (node 1 of 2, the bucket as `local.checkpoint_url` names it).
CLOUD_VALUES: dict[str, Any] = {
    "node_rank": 1, "rdzv_host": "10.0.0.5", "image": "img:1", "secrets": {}, "region": "us-east-1",
    "project": "proj", "storage_account": "acct", "client_id": "cid", "key_vault_name": "kv",
}  # fmt: skip
CLOUD_BUCKETS = {"aws": "s3://ckpt/run", "gcp": "gs://ckpt/run", "azure": "az://ckpt/run"}


def _docker_argv(script: str, env: dict[str, str], tmp: Path) -> list[str]:
    """Run a node's gaudi3-node `script` with a `docker` that records its arguments; the `gaudi3` ones."""
    bin_dir = tmp / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "docker").write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$ARGS_OUT"\n')
    (bin_dir / "docker").chmod(0o755)
    full = {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGS_OUT": str(tmp / "docker-args")}
    subprocess.run(["bash", "-c", script], env=full, check=True)
    argv = (tmp / "docker-args").read_text().split("\0")[:-1]
    return argv[argv.index(full["IMAGE"]) + 1 :]


def _env_file(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def node_train_argv(out: Path, target: str, tmp: Path, *, nodes: int = 2, per_node: int = 8) -> list[str]:
    """The `gaudi3` arguments node 1 (node 0 with one node) of a render in `out` runs: the k8s pod's args (the
    operator's PET_NODE_RANK filled in), or the Terraform / Ansible node script run for real with the values
    Terraform / Ansible fill in. The run config is at /etc/gaudi3/run.yaml in it (`out`/docker/run.yaml here)."""
    rank = str(min(1, nodes - 1))
    if target == "k8s":
        (job,) = yaml.safe_load_all((out / "k8s" / "pytorchjob.yaml").read_text())
        pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        return [a.replace("$(PET_NODE_RANK)", rank) for a in pod["containers"][0]["args"]]
    if target == "onprem":
        import jinja2

        inventory = yaml.safe_load((out / "ansible" / "inventory.yaml").read_text())
        group = inventory["all"]["children"]["gaudi3_nodes"]
        values = {**group["vars"], "node_rank": rank, "ansible_managed": "ansible"}
        env_text = jinja2.Template((out / "ansible" / "templates" / "node.env.j2").read_text()).render(values)
        return _docker_argv((out / "ansible" / "files" / "gaudi3-node").read_text(), _env_file(env_text), tmp)
    values = {**CLOUD_VALUES, "node_rank": rank, "nnodes": nodes, "nproc_per_node": per_node,
              "checkpoint_url": CLOUD_BUCKETS[target]}  # fmt: skip
    script = templatefile((out / "terraform" / "bootstrap.sh.tftpl").read_text(), values)
    files = dict(re.findall(r"cat > (\S+) <<'GAUDI3_EOF'\n(.*?)GAUDI3_EOF\n", script, re.S))
    return _docker_argv(files["/usr/local/bin/gaudi3-node"], _env_file(files["/etc/gaudi3/node.env"]), tmp)


def resolve_node_argv(out: Path, argv: list[str]) -> Any:
    """The RunConfig a node's `gaudi3 train` resolves from `argv` (from `node_train_argv`), by the project's own
    loader, with the rendered run config as its --config."""
    from gaudi3_scale.train.config import resolve_config

    assert argv[:3] == ["train", "--config", "/etc/gaudi3/run.yaml"], argv
    rest = argv[3:]
    out_dir = rest[rest.index("--out") + 1]
    overrides = [a for a in rest if a.startswith("--") and "=" in a]
    assert len(overrides) == len([a for a in rest if a.startswith("--") and a not in
                                  ("--out", "--no-progress", "--sample-tokens")]), argv  # fmt: skip
    return resolve_config(str(out / "docker" / "run.yaml"), overrides, out_dir=out_dir)
