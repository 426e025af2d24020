"""What every training node runs, on any target that manages machines (aws, azure, gcp, onprem).

A node runs the training image (`DeploySpec.image`) with Docker, not a pip install: the image pins the whole stack
(torch, the CUDA or Intel Gaudi software) and is the same one the Kubernetes target runs. Four files make a node:

  /etc/gaudi3/run.yaml                        the run config
  /etc/gaudi3/node.env                        this node's rank, the master's address, the image, the checkpoint URL
  /usr/local/bin/gaudi3-node                  `docker run --entrypoint gaudi3 IMAGE train …` (deploy/node_command.py)
  /etc/systemd/system/gaudi3-train.service    starts it at boot and restarts it after a failure

Secrets are never in these files: `node.env` names a file of environment variables (SECRETS_ENV_FILE) that is
written at start from the cloud's secret store (Terraform targets) or provisioned by the operator (onprem).
"""

from __future__ import annotations

import shlex

from gaudi3_scale.deploy.containers import NOT_VALIDATED
from gaudi3_scale.deploy.node_command import Filled, NodeSlots, Slot, check_node_config, train_args
from gaudi3_scale.deploy.quoting import comment, yaml_text
from gaudi3_scale.deploy.spec import DeploySpec

__all__ = [
    "NO_RESTART_EXIT_CODES",
    "RDZV_PORT",
    "node_env",
    "node_slots",
    "run_config_yaml",
    "run_script",
    "systemd_unit",
]

RDZV_PORT = 29500  # torchrun's default c10d rendezvous port, on the master (node_rank 0)
# The exit codes `gaudi3 train` ends with on purpose (cli/train_cmd.py). Restarting would not help, so systemd does
# not; crashes and preemptions restart. The unit file's comment is written from this table.
NO_RESTART_EXIT_CODES = {
    2: "bad input",
    3: "cost.budget_usd reached",
    4: "paused by the spot policy",
    5: "stopped by the training-health guard: the run diverged, or a spike past health.max_rollbacks",
}

# Docker flags that give the container every local accelerator.
_NVIDIA = "args+=(--gpus all)"
# Intel's documented `docker run` for Gaudi: the habana container runtime, all cards, and sys_nice.
_GAUDI = (
    f"# Gaudi settings (--runtime habana, HABANA_VISIBLE_DEVICES, sys_nice): {NOT_VALIDATED}.\n"
    "args+=(--runtime habana -e HABANA_VISIBLE_DEVICES=all --cap-add sys_nice)"
)

_RUN_SCRIPT = """#!/bin/bash
# This node's share of the training job: one container with every local accelerator; `gaudi3 train` starts
# nproc_per_node ranks in it and meets the other nodes at the master's rendezvous. Settings: /etc/gaudi3/node.env.
set -euo pipefail
if ! command -v docker >/dev/null; then
  echo "gaudi3-node: docker is not installed; use a machine image with Docker and the accelerator's container runtime" >&2
  exit 2
fi
args=(--rm --name gaudi3-train --network host --ipc host --ulimit memlock=-1 --ulimit stack=67108864
  -v /etc/gaudi3/run.yaml:/etc/gaudi3/run.yaml:ro -v /var/lib/gaudi3:/workspace -w /workspace)
@ACCELERATOR@
# RDMA devices (AWS EFA, InfiniBand) where the machine has them: NCCL / libfabric use them from the container.
for dev in /dev/infiniband/*; do
  if [ -c "$dev" ]; then args+=(--device "$dev"); fi
done
if [ -s "$SECRETS_ENV_FILE" ]; then args+=(--env-file "$SECRETS_ENV_FILE"); fi
for name in $PASS_ENV; do args+=(-e "$name"); done
@TRAIN@
# --entrypoint: the command is `gaudi3 train …` whatever the image's own entrypoint is.
exec docker run "${args[@]}" --entrypoint gaudi3 "$IMAGE" "${train[@]}"
"""


def node_slots(spec: DeploySpec, *, rdzv_host: str, checkpoint_url: Slot | None) -> NodeSlots:
    """The node command's values on these nodes: node.env's, as bash expands them in gaudi3-node (`-var nodes=` /
    `-var nproc_per_node=` change them without a re-render). `rdzv_host`: node 0's address as the render's check
    sees it; `checkpoint_url`: the bucket the target creates (`node_command.target_bucket`), or None. Each node
    keeps --out on its own disk (/var/lib/gaudi3)."""
    return NodeSlots(
        node_rank=Filled('"$NODE_RANK"', "0"),
        rdzv_endpoint=Filled('"$RDZV_HOST:$RDZV_PORT"', f"{rdzv_host}:{RDZV_PORT}"),
        nnodes=Filled('"$NNODES"', str(spec.nodes)),
        nproc_per_node=Filled('"$NPROC_PER_NODE"', str(spec.per_node)),
        shared_out=False,
        checkpoint_url=checkpoint_url,
    )


def _bash_word(slot: Slot) -> str:
    return slot.expr if isinstance(slot, Filled) else shlex.quote(slot)


def run_script(spec: DeploySpec, slots: NodeSlots) -> str:
    """/usr/local/bin/gaudi3-node for `spec`'s accelerator (Gaudi: the habana runtime; else NVIDIA GPUs), running
    `node_command.train_args` with `slots`; the run config is checked with the same `slots` first."""
    check_node_config(spec, slots)
    args = train_args(spec.name, slots, _bash_word)
    first = args.index("--sample-tokens") + 2  # the fixed part on the first line, one override a line
    train = "train=(" + " ".join(args[:first]) + "".join(f"\n  {a}" for a in args[first:]) + ")"
    gaudi = spec.accelerator.startswith("gaudi")
    return _RUN_SCRIPT.replace("@ACCELERATOR@", _GAUDI if gaudi else _NVIDIA).replace("@TRAIN@", train)


def systemd_unit(*, fetch_secrets: bool) -> str:
    """gaudi3-train.service; `fetch_secrets` runs /usr/local/bin/gaudi3-secrets (the cloud's secret store) first."""
    pre = "ExecStartPre=/usr/local/bin/gaudi3-secrets\n" if fetch_secrets else ""
    codes = " ".join(map(str, NO_RESTART_EXIT_CODES))
    why = "# gaudi3 train exits on purpose with\n" + "".join(
        f"#   {code}: {meaning}\n" for code, meaning in NO_RESTART_EXIT_CODES.items()
    )
    return (
        "[Unit]\n"
        "Description=gaudi3-scale training (this node's ranks)\n"
        "Wants=network-online.target docker.service\n"
        "After=network-online.target docker.service\n"
        "\n"
        "[Service]\n"
        "EnvironmentFile=/etc/gaudi3/node.env\n"
        f"{pre}"
        "ExecStartPre=-/usr/bin/env docker rm -f gaudi3-train\n"
        "ExecStart=/usr/local/bin/gaudi3-node\n"
        "Restart=on-failure\n"
        "RestartSec=30\n"
        f"{why}"
        f"RestartPreventExitStatus={codes}\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def node_env(
    *,
    node_rank: str,
    nnodes: str,
    nproc_per_node: str,
    rdzv_host: str,
    image: str,
    checkpoint_url: str,
    secrets_env_file: str,
    pass_env: dict[str, str] | None = None,
) -> str:
    """/etc/gaudi3/node.env. Values may be template expressions (Terraform `${…}`, Jinja `{{ … }}`); `pass_env`
    are extra variables handed into the container by name (storage account names, client ids: no secrets)."""
    passed = pass_env or {}
    lines = [
        f"NODE_RANK={node_rank}",
        f"NNODES={nnodes}",
        f"NPROC_PER_NODE={nproc_per_node}",
        f"RDZV_HOST={rdzv_host}",
        f"RDZV_PORT={RDZV_PORT}",
        f"IMAGE={image}",
        f"CHECKPOINT_URL={checkpoint_url}",
        f"SECRETS_ENV_FILE={secrets_env_file}",
        f"PASS_ENV={' '.join(passed)}",
        *(f"{name}={value}" for name, value in passed.items()),
    ]
    return "\n".join(lines) + "\n"


def run_config_yaml(spec: DeploySpec) -> str:
    """The run config the nodes train with, as the YAML `gaudi3 train --config` reads."""
    source = comment(spec.config_path.name)
    return (
        f"# The run config of {spec.name}, resolved by `gaudi3 deploy render` from {source}.\n"
        + yaml_text(spec.run_config)
    )
