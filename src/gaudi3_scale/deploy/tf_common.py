"""What the three Terraform targets share: HCL text helpers, the variables and the node bootstrap template.

Each cloud module (`tf_aws`, `tf_azure`, `tf_gcp`) renders `versions.tf`, `variables.tf`, `main.tf`, `outputs.tf`
and `bootstrap.sh.tftpl` into `terraform/` (run `terraform init && terraform apply` there, or `gaudi3 deploy apply`). `main.tf` and `outputs.tf` are fixed text that reads only variables; what a render
decides (instance type, node count, region, image) are the variables' defaults, so a user changes a deployment with
`-var` or a `terraform.tfvars`, never by editing generated code. No secret value is ever in these files (nor in
Terraform's state): the `secrets` variable maps environment variable names to names in the cloud's secret store
(SSM Parameter Store / Key Vault / Secret Manager), and each node reads the values when its training starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gaudi3_scale.deploy.bootstrap import (
    RDZV_PORT,
    node_env,
    node_slots,
    run_config_yaml,
    run_script,
    systemd_unit,
)
from gaudi3_scale.deploy.containers import IMAGE_UID
from gaudi3_scale.deploy.grammar import OCI_REFERENCE, REGIONS, RUN_NAME, SECRET_NAME, anchored
from gaudi3_scale.deploy.node_command import Filled, NodeSlots, target_bucket
from gaudi3_scale.deploy.quoting import hcl_string, sh_heredoc, tftpl_literal
from gaudi3_scale.deploy.spec import BUCKET_SCHEMES, DeploySpec
from gaudi3_scale.metering.catalog import Instance

__all__ = [
    "BOOTSTRAP",
    "REQUIRED",
    "Variable",
    "common_variables",
    "default_region",
    "regex_validation",
    "region_variable",
    "render_bootstrap",
    "render_variables",
    "secrets_fetcher",
    "tf_files",
]

BOOTSTRAP = "bootstrap.sh.tftpl"  # the per-node script, filled in by Terraform's templatefile()
TF_DIR = "terraform"  # the rendered Terraform's directory under --out (beside docker/ and the other targets')
UNKNOWN_REGION = (
    "unknown"  # the catalog's region of an entry with no sourced region (metering/instances.yaml)
)


def tf_files(
    *, versions: str, variables: list[Variable], main: str, outputs: str, bootstrap: str
) -> dict[str, str]:
    """One cloud's Terraform root module, in its place under --out (terraform/): the same five files per cloud."""
    files = {
        "versions.tf": versions,
        "variables.tf": render_variables(variables),
        "main.tf": main,
        "outputs.tf": outputs,
        BOOTSTRAP: bootstrap,
    }
    return {f"{TF_DIR}/{name}": text for name, text in files.items()}


def _hcl_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ", ".join(_hcl_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{}"
            if not value
            else "{ " + ", ".join(f"{hcl_string(str(k))} = {_hcl_value(v)}" for k, v in value.items()) + " }"
        )
    return hcl_string(str(value))


REQUIRED: Any = object()  # a Variable default: none, Terraform asks (an unknowable value, or a secret)


@dataclass(frozen=True)
class Variable:
    name: str
    type: str
    description: str
    default: Any = REQUIRED
    validations: tuple[tuple[str, str], ...] = ()  # (condition, error message) each


def regex_validation(name: str, pattern: str, message: str) -> tuple[str, str]:
    """A validation block holding `var.<name>` to a grammar of `deploy/grammar.py`: a `-var` override is checked
    against the same pattern as the rendered default. Such values are written into the node bootstrap by
    templatefile() as they are, so this is what keeps a newline or a quote out of its heredocs and env file."""
    return f"can(regex({hcl_string(anchored(pattern))}, var.{name}))", message


def region_variable(target: str, name: str, description: str, default: Any) -> Variable:
    """The cloud's region (gcp: zone) variable, validated like --region."""
    pattern, allowed = REGIONS[target]
    return Variable(
        name, "string", description, default, (regex_validation(name, pattern, f"{name}: {allowed}"),)
    )


def render_variables(variables: list[Variable]) -> str:
    """variables.tf, laid out the way `terraform fmt` lays it out."""
    blocks = []
    for v in variables:
        attrs = [("description", hcl_string(v.description)), ("type", v.type)]
        if v.default is not REQUIRED:
            attrs.append(("default", _hcl_value(v.default)))
        width = max(len(k) for k, _ in attrs)
        lines = [f'variable "{v.name}" {{'] + [f"  {k.ljust(width)} = {val}" for k, val in attrs]
        for condition, message in v.validations:
            lines += ["", "  validation {", f"    condition     = {condition}",
                      f"    error_message = {hcl_string(message)}", "  }"]  # fmt: skip
        blocks.append("\n".join([*lines, "}"]))
    return "\n\n".join(blocks) + "\n"


# `gaudi3 deploy render` checked the run config on the rendered geometry (the batch split, tp / pp sizes); a `-var`
# cannot re-run that check, so the variables say so (render again with --nodes / --per-node instead).
_RECHECK = (
    " (the render checked the run config on its default: re-render with another value rather than -var)"
)


def _whole(name: str) -> tuple[str, str]:
    """A validation: a whole number of at least 1 (a node or rank count; 0 or 1.5 makes every node refuse)."""
    return (
        f"var.{name} >= 1 && floor(var.{name}) == var.{name}",
        f"{name} must be a whole number of at least 1",
    )


def common_variables(spec: DeploySpec, instance_type: str) -> list[Variable]:
    """The variables every cloud has, with the render's choices as defaults."""
    return [
        Variable("name", "string", "prefix of every resource name (the run name)", spec.name,
                 (regex_validation("name", RUN_NAME,
                                   "name: 1-40 lower-case letters, digits and '-', not starting or ending with '-'"),)),
        Variable("nodes", "number", "machines to train on; node 0 is the rendezvous master" + _RECHECK,
                 spec.nodes, (_whole("nodes"),)),
        Variable("nproc_per_node", "number", "training processes per node (one per accelerator)" + _RECHECK,
                 spec.per_node, (_whole("nproc_per_node"),)),
        Variable("instance_type", "string", "machine type (from the gaudi3-scale instance catalog)", instance_type),
        Variable("image", "string", "training container image every node runs (must be pullable from the nodes)",
                 spec.image, (regex_validation("image", OCI_REFERENCE, "image: an OCI image reference such as "
                                               "registry.example.com/team/train:1.0"),)),
        Variable("ssh_allowed_cidr", "string", "CIDR allowed to reach the nodes on port 22; null: no SSH rule",
                 None),
        Variable("secrets", "map(string)", "environment variable name -> the secret store's name for the value "
                 "(read by each node at start; values never appear in Terraform files or state)", {},
                 (('alltrue([for k in keys(var.secrets) : can(regex("^[A-Za-z_][A-Za-z0-9_]*$", k))])',
                   "secrets: keys must be environment variable names"),
                  (f"alltrue([for v in values(var.secrets) : can(regex({hcl_string(anchored(SECRET_NAME))}, v))])",
                   "secrets: values must be secret names (letters, digits, '/', '_', '.', '-')"))),
        Variable("checkpoint_noncurrent_days", "number",
                 "days an overwritten or deleted checkpoint object version is kept", 30),
    ]  # fmt: skip


def default_region(spec: DeploySpec, instance: Instance) -> Any:
    """--region, else the catalog instance's region; REQUIRED where neither is known (Terraform asks)."""
    if spec.region:
        return spec.region
    return REQUIRED if instance.region == UNKNOWN_REGION else instance.region


def render_bootstrap(spec: DeploySpec, *, fetch_secrets: str, pass_env: dict[str, str]) -> str:
    """bootstrap.sh.tftpl: writes the node files and starts training. Terraform fills in `node_rank`,
    `rdzv_host`, `nnodes`, `nproc_per_node`, `image`, `checkpoint_url`, `secrets` and the `pass_env` values
    (template expressions). `fetch_secrets` is the cloud's /usr/local/bin/gaudi3-secrets."""
    env = node_env(
        node_rank="${node_rank}",
        nnodes="${nnodes}",
        nproc_per_node="${nproc_per_node}",
        rdzv_host="${rdzv_host}",
        image="${image}",
        checkpoint_url="${checkpoint_url}",
        secrets_env_file="/run/gaudi3/secrets.env",
        pass_env=pass_env,
    )
    files = [
        ("/etc/gaudi3/run.yaml", "0644", tftpl_literal(run_config_yaml(spec))),
        ("/etc/gaudi3/node.env", "0644", env),
        ("/etc/gaudi3/secret-refs", "0644",
         "%{ for env_name, ref in secrets ~}\n${env_name}=${ref}\n%{ endfor ~}\n"),
        ("/usr/local/bin/gaudi3-secrets", "0755", tftpl_literal(fetch_secrets)),
        ("/usr/local/bin/gaudi3-node", "0755", tftpl_literal(run_script(spec, _node_slots(spec)))),
        ("/etc/systemd/system/gaudi3-train.service", "0644", tftpl_literal(systemd_unit(fetch_secrets=True))),
    ]  # fmt: skip
    parts = [
        "#!/bin/bash\n"
        "# gaudi3-scale node bootstrap, rendered by `gaudi3 deploy render`; Terraform's templatefile() fills in\n"
        "# this node's rank and the master's address. It runs as root at first boot (user data / startup script)\n"
        "# and is safe to run again.\n"
        "set -euo pipefail\n"
        "install -d -m 0755 /etc/gaudi3\n"
        # the image runs as IMAGE_UID: the workspace (outputs, checkpoints) must be its own
        f"install -d -m 0750 -o {IMAGE_UID} -g {IMAGE_UID} /var/lib/gaudi3\n"
    ]
    for path, mode, text in files:
        parts.append(sh_heredoc(f"cat > {path}", text) + f"chmod {mode} {path}\n")
    parts.append("systemctl daemon-reload\nsystemctl enable --now gaudi3-train.service\n")
    return "".join(parts)


def _node_slots(spec: DeploySpec) -> NodeSlots:
    """The node command's values on a cloud VM: node.env's, with the bucket Terraform creates as the checkpoint
    mirror (node 0's address and the bucket name are only known once applied: the check uses stand-ins)."""
    bucket = f"{BUCKET_SCHEMES[spec.target]}://{spec.name}-checkpoints/{spec.name}"
    url = target_bucket(spec.run_config, Filled('"$CHECKPOINT_URL"', bucket))
    return node_slots(spec, rdzv_host="10.0.0.1", checkpoint_url=url)


def secrets_fetcher(store: str, fetch: str) -> str:
    """/usr/local/bin/gaudi3-secrets: /run/gaudi3/secrets.env (tmpfs, root only) from `store`, one NAME=value
    line per NAME=secret-name line of /etc/gaudi3/secret-refs. `fetch` defines the bash function `fetch NAME`."""
    return (
        "#!/bin/bash\n"
        f"# Reads the secrets named in /etc/gaudi3/secret-refs from {store} into /run/gaudi3/secrets.env\n"
        "# (tmpfs, root only), which gaudi3-node hands to the container. Runs before every start of the service.\n"
        "set -euo pipefail\n"
        "umask 077\n"
        f"{fetch}"
        "install -d -m 0700 /run/gaudi3\n"
        "out=/run/gaudi3/secrets.env.tmp\n"
        ': > "$out"\n'
        "while IFS='=' read -r name ref; do\n"
        '  if [ -z "$name" ]; then continue; fi\n'
        '  value=$(fetch "$ref")\n'
        '  printf \'%s=%s\\n\' "$name" "$value" >> "$out"\n'
        "done < /etc/gaudi3/secret-refs\n"
        'mv "$out" /run/gaudi3/secrets.env\n'
    )


def versions_tf(name: str, source: str, version: str, why: str = "") -> str:
    """versions.tf: Terraform ≥ 1.5 and the one provider, pinned (`why`: a comment on the pin)."""
    comment = f"      # {why}\n" if why else ""
    pad = "" if why else " "  # terraform fmt aligns `=` of adjacent attributes; a comment line breaks the run
    return (
        "terraform {\n"
        '  required_version = ">= 1.5"\n\n'
        "  required_providers {\n"
        f"    {name} = {{\n"
        f'      source {pad}= "{source}"\n'
        f"{comment}"
        f'      version = "{version}"\n'
        "    }\n"
        "  }\n"
        "}\n"
    )


def outputs_tf(addresses: str, checkpoint_note: str = "", extra: str = "") -> str:
    """outputs.tf: every node's private address (`addresses`: a splat expression over the nodes' addresses, e.g.
    `aws_network_interface.nodes[*].private_ip`), the rendezvous endpoint, the checkpoint URL, then `extra`."""
    first = addresses.replace("[*]", "[0]")
    return (
        'output "node_private_ips" {\n'
        '  description = "private address of each node, by node_rank"\n'
        f"  value       = {addresses}\n"
        "}\n\n"
        'output "master_address" {\n'
        '  description = "the c10d rendezvous endpoint (node 0)"\n'
        f'  value       = "${{{first}}}:{RDZV_PORT}"\n'
        "}\n\n"
        'output "checkpoint_url" {\n'
        f'  description = "where the nodes mirror their checkpoints (checkpoint.remote_url{checkpoint_note})"\n'
        "  value       = local.checkpoint_url\n"
        "}\n" + (f"\n{extra}" if extra else "")
    )
