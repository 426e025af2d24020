"""The one `gaudi3 train` command a deployed node runs, and the check that the run config accepts it.

Every target renders its nodes' command from `train_args` (the Kubernetes pods, the Terraform and on-prem nodes'
`gaudi3-node` script) and checks the run config at render time with `check_node_config` on exactly those arguments,
as the node's `gaudi3 train --config run.yaml …` will resolve them: a config the nodes would refuse is one line at
render, not an exit 2 on every node of a billed cluster. The Metaflow flow trains on one node and takes its geometry
from `geometry_overrides`.

Values a target only knows on the node (its rank; on Terraform nodes the node count, which `-var nodes=` may change)
are `Filled`: how the target writes them (`$(PET_NODE_RANK)`, `"$NODE_RANK"`) and what they are on node 0 of this
render, which is what the check resolves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.deploy.spec import DeploySpec

__all__ = [
    "CONFIG_FILE",
    "WORKSPACE",
    "Deployment",
    "Filled",
    "NodeSlots",
    "Slot",
    "check_node_config",
    "deployment_run_config",
    "geometry_overrides",
    "node_out",
    "override_args",
    "target_bucket",
    "train_args",
]

CONFIG_FILE = "/etc/gaudi3/run.yaml"  # where every target mounts or writes the rendered run config
WORKSPACE = "/workspace"  # the node's writable volume (a PVC, an emptyDir, the host's /var/lib/gaudi3)


@dataclass(frozen=True)
class Filled:
    """A value filled in on the node: `expr` as the target writes it, `value` what it is on node 0 of this render."""

    expr: str
    value: str


Slot = str | Filled  # a literal, or a value the node fills in


@dataclass(frozen=True, kw_only=True)
class NodeSlots:
    """What differs between targets in the node's command."""

    node_rank: Slot
    # HOST:PORT of node 0: the deployment's own, never the run config file's; None: one node on its own loopback
    rdzv_endpoint: Slot | None
    nnodes: Slot
    nproc_per_node: Slot
    shared_out: bool  # whether every node sees the same --out (a shared volume), or each node its own disk
    # the target's bucket (`target_bucket`); None: the run config's remote_url
    checkpoint_url: Slot | None = None
    # the target's own overrides (k8s: restarts, the metrics address), after the others
    extra: tuple[tuple[str, Slot], ...] = ()


def geometry_overrides(
    *, nnodes: Slot, nproc_per_node: Slot | None, node_rank: Slot, rdzv_endpoint: Slot | None
) -> list[tuple[str, Slot]]:
    """The `parallel.*` overrides of a node; `rdzv_endpoint` None: one node, rendezvous on its own loopback (a
    run config file's multi-node endpoint would make it wait for a node 0 that does not exist);
    `nproc_per_node` None: the run config's."""
    pairs: list[tuple[str, Slot]] = [("parallel.nnodes", nnodes)]
    if nproc_per_node is not None:
        pairs.append(("parallel.nproc_per_node", nproc_per_node))
    pairs += [
        ("parallel.node_rank", node_rank),
        ("parallel.rdzv_endpoint", "null" if rdzv_endpoint is None else rdzv_endpoint),
    ]
    return pairs


def deployment_run_config(config_path: str, *, nodes: int, per_node: int) -> tuple[str, dict[str, Any]]:
    """(run name, run config) of `config_path` for a deployment of `nodes` × `per_node` ranks: the file resolved
    with that geometry (a tp_size 8 file needs no nproc_per_node of its own), written as one node of the
    deployment (nnodes 1 on its own loopback, which the flow trains; every node's command sets its own geometry)."""
    from gaudi3_scale.config.errors import ConfigError
    from gaudi3_scale.train.config import config_dict, resolve_config

    endpoint = None if nodes == 1 else "node-0:29500"  # a stand-in: each target's check uses its real one
    pairs = geometry_overrides(
        nnodes=str(nodes), nproc_per_node=str(per_node), node_rank="0", rdzv_endpoint=endpoint
    )
    try:
        cfg = resolve_config(config_path, [f"--{key}={value}" for key, value in pairs])
    except ConfigError as exc:
        raise UserInputError(f"{config_path} on {nodes} node(s) × {per_node} per node: {exc}") from None
    run_config = config_dict(cfg)
    run_config["parallel"].update(nnodes=1, node_rank=0, rdzv_endpoint=None)
    return cfg.name, run_config


def node_out(name: str) -> str:
    """The node's --out: on the mounted workspace, whatever the run config's out_dir says (a path outside the
    workspace would be written into the container's throw-away layer)."""
    return f"{WORKSPACE}/runs/{name}"


def target_bucket(run_config: Mapping[str, Any], url: Slot) -> Slot | None:
    """`NodeSlots.checkpoint_url` for a target that creates a bucket: `url`, only where checkpoints are written
    (with checkpoint.enabled false the run refuses a remote_url: "would be ignored")."""
    return url if run_config["checkpoint"]["enabled"] else None


def _overrides(slots: NodeSlots) -> list[tuple[str, Slot]]:
    pairs = geometry_overrides(
        nnodes=slots.nnodes,
        nproc_per_node=slots.nproc_per_node,
        node_rank=slots.node_rank,
        rdzv_endpoint=slots.rdzv_endpoint,
    )
    if slots.checkpoint_url is not None:
        pairs.append(("checkpoint.remote_url", slots.checkpoint_url))
    return pairs + list(slots.extra)


def override_args(slots: NodeSlots, word: Callable[[Slot], str]) -> list[str]:
    """The `--section.field=VALUE` overrides of `slots`; `word` writes a slot as the target's syntax needs (quoted
    for bash, `$$`-escaped for Kubernetes)."""
    return [f"--{key}={word(value)}" for key, value in _overrides(slots)]


def train_args(name: str, slots: NodeSlots, word: Callable[[Slot], str]) -> list[str]:
    """`gaudi3`'s arguments on a node of the deployment `name` (after the program name)."""
    args = [
        "train",
        "--config",
        CONFIG_FILE,
        "--out",
        node_out(name),
        "--no-progress",
        "--sample-tokens",
        "0",
    ]
    return [word(a) for a in args] + override_args(slots, word)


def _value(slot: Slot) -> str:
    return slot.value if isinstance(slot, Filled) else slot


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """What the check needs of a deployment (a `DeploySpec`'s fields; the Kubernetes plan has them too)."""

    target: str
    name: str
    nodes: int
    per_node: int
    gaudi: bool
    run_config: Mapping[str, Any]

    @classmethod
    def of(cls, spec: DeploySpec) -> Deployment:
        return cls(target=spec.target, name=spec.name, nodes=spec.nodes, per_node=spec.per_node,
                   gaudi=spec.accelerator.startswith("gaudi"), run_config=spec.run_config)  # fmt: skip


def check_node_config(deployment: Deployment | DeploySpec, slots: NodeSlots) -> Any:
    """The run config as node 0 resolves `train_args` (its `--config` file, then these overrides and --out), or
    one line naming what it would refuse at start; returns the resolved RunConfig."""
    from gaudi3_scale.config.core import parse_overrides
    from gaudi3_scale.config.errors import ConfigError
    from gaudi3_scale.train.config import build_run_config  # no torch behind it

    d = Deployment.of(deployment) if isinstance(deployment, DeploySpec) else deployment
    pairs = parse_overrides([f"--{key}={_value(value)}" for key, value in _overrides(slots)])
    try:
        # the whole config as the base, as a node's `gaudi3 train --config run.yaml` reads it (max_steps null
        # beside max_epochs: `config_dict`)
        cfg = build_run_config(None, [*pairs, ("out_dir", node_out(d.name))], base=d.run_config)
    except ConfigError as exc:
        raise UserInputError(f"{d.nodes} node(s) × {d.per_node} per node: {exc}") from None
    if d.gaudi:
        from gaudi3_scale.forecast.run import check_runs_on

        check_runs_on(
            cfg, "hpu"
        )  # what every rank would refuse at start (DeepSpeed, reduce-overhead, 16-mixed)
    _check_metrics_ports(cfg, d.per_node)
    _check_shared_out(d, slots, cfg)
    return cfg


def _check_metrics_ports(cfg: Any, per_node: int) -> None:
    """Rank r of a node serves metrics on monitor.metrics_port + r: none of those may be node 0's rendezvous port."""
    from gaudi3_scale.config.hosts import parse_endpoint
    from gaudi3_scale.deploy.monitoring import metrics_port

    endpoint = cfg.parallel.rdzv_endpoint
    if endpoint is not None and cfg.monitor.metrics_port is not None:
        _, port = parse_endpoint("parallel.rdzv_endpoint", endpoint)
        metrics_port(cfg.monitor.metrics_port, per_node, rdzv_port=port, rdzv_field="the rendezvous port")


def _check_shared_out(d: Deployment, slots: NodeSlots, cfg: Any) -> None:
    """Nodes whose --out is on their own disks: the rule `train.nodes.nodes_problem` applies at start on every
    rank (restated here because that module imports torch; a test holds the two to the same answers): with
    checkpoints, a strategy that writes a file per rank needs one --out for all nodes, and a single-file
    checkpoint needs checkpoint.remote_url for the other nodes to resume from."""
    from gaudi3_scale.train.config import per_rank_checkpoints

    if slots.shared_out or d.nodes == 1 or not cfg.checkpoint.enabled:
        return
    where = f"--target {d.target}: each node keeps the run's --out on its own disk"
    if (setting := per_rank_checkpoints(cfg.parallel)) is not None:
        raise UserInputError(
            f"{where}, but with {setting} every rank writes its part of each checkpoint there for rank 0 to "
            f"commit, which {d.nodes} nodes cannot (the run would refuse to start); use --target k8s with "
            "k8s.storage pvc (a volume every node mounts), --nodes 1, or parallel.strategy ddp"
        )
    if not cfg.checkpoint.remote_url:
        raise UserInputError(
            f"{where}, so only node 0 could resume from its checkpoints (the run would refuse to start); set "
            "checkpoint.remote_url (the other nodes resume from it), or use --nodes 1"
        )
