"""What a deployment is rendered from: the target, the accelerator, the node count and the run config."""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.deploy.grammar import RUN_NAME, check_host, check_image, check_region, matches
from gaudi3_scale.deploy.instances import ACCELERATORS, instance_for

__all__ = ["ACCELERATORS", "TARGETS", "DeploySpec", "gaudi_run_config", "resource_name"]

TARGETS = ("aws", "azure", "gcp", "onprem", "k8s", "ci")


@dataclass(frozen=True, kw_only=True)
class DeploySpec:
    target: str  # one of TARGETS
    accelerator: str  # a key of ACCELERATORS
    nodes: int
    config_path: Path  # the run config the job trains with (shipped into the image / a ConfigMap)
    run_config: dict[str, Any]  # its resolved content (config.core.to_dict of the RunConfig)
    name: str  # resource name prefix: the run name, DNS-safe
    image: str  # container image the nodes / pods run: an OCI image reference
    per_node: int = 8  # accelerators (and training processes) per node
    region: str | None = None  # cloud targets: region (gcp: zone); default: the catalog instance's
    hosts: tuple[str, ...] = ()  # onprem: the machines (host names or IP addresses)
    extra: dict[str, Any] = field(default_factory=dict)  # target-specific options

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise UserInputError(f"--target: must be one of {', '.join(TARGETS)}, got {self.target!r}")
        if self.accelerator not in ACCELERATORS:
            raise UserInputError(
                f"--accelerator: must be one of {', '.join(ACCELERATORS)}, got {self.accelerator!r}"
            )
        if self.accelerator.startswith("gaudi"):
            # frozen: the resolved run config is replaced once, here, before any renderer reads it
            object.__setattr__(self, "run_config", gaudi_run_config(self.accelerator, self.run_config))
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise UserInputError(f"--nodes: must be a positive integer, got {self.nodes!r}")
        if isinstance(self.per_node, bool) or not isinstance(self.per_node, int) or self.per_node < 1:
            raise UserInputError(f"--per-node: must be a positive integer, got {self.per_node!r}")
        if not matches(RUN_NAME, self.name):
            raise UserInputError(
                f"the run name {self.name!r} cannot name cloud resources: use 1-40 lower-case letters, digits "
                "and '-' (`deploy.spec.resource_name` derives such a name from any run name)"
            )
        # Every value below reaches rendered files: each is held to its field's grammar (deploy/grammar.py), and an
        # option the target does not use is refused rather than silently ignored.
        check_image(self.image)
        if self.region is not None:
            check_region(self.target, self.region)
        if self.hosts and self.target != "onprem":
            raise UserInputError(
                f"--hosts: only --target onprem takes hosts (--target {self.target} does not)"
            )
        for host in self.hosts:
            check_host(host)

    @property
    def accelerator_spec_name(self) -> str:
        return ACCELERATORS[self.accelerator]

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node


def gaudi_run_config(accelerator: str, run_config: dict[str, Any]) -> dict[str, Any]:
    """The run config a Gaudi deployment trains with: `train.device` hpu, written into every rendered run config,
    as `auto` trains on the CPUs of a node whose Gaudis are not visible at start (driver, container runtime) and
    the deployment asked for Gaudis; cpu or cuda is refused. Not yet validated on Gaudi hardware."""
    device = run_config.get("train", {}).get("device", "auto")
    if device not in ("auto", "hpu"):
        raise ConfigError(
            "train.device",
            f"{brief(device)} in a Gaudi deployment (--accelerator {accelerator}); allowed: hpu, or auto "
            "(rendered as hpu)",
        )
    pinned = copy.deepcopy(run_config)
    pinned.setdefault("train", {})["device"] = "hpu"
    return pinned


RESOURCE_NAME_MAX = (
    40  # RUN_NAME's longest: names are built from it with suffixes (`-checkpoint-credentials`)
)
_HASH_CHARS = 8


def resource_name(run_name: str) -> str:
    """The prefix of every resource a deployment names (instances, buckets, the namespace, jobs), from the run name.

    The run name itself when every target takes it (`RUN_NAME`, starting with a letter as Kubernetes jobs and Google
    Cloud resources must); else lower-cased, each run of other characters one '-' ('llama3.2-1b' → 'llama3-2-1b'),
    'run-' before a leading digit, and a name longer than 40 characters cut to fit with the first 8 hex digits of
    the run name's SHA-256 (two long names that share their start stay apart). The same run name always gives the
    same resource name, on every target.
    """
    if matches(RUN_NAME, run_name) and run_name[0].isalpha():
        return run_name
    name = re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-")
    if not name[:1].isalpha():
        name = f"run-{name}".rstrip("-")
    if len(name) > RESOURCE_NAME_MAX:
        digest = hashlib.sha256(run_name.encode()).hexdigest()[:_HASH_CHARS]
        name = f"{name[: RESOURCE_NAME_MAX - _HASH_CHARS - 1].rstrip('-')}-{digest}"
    assert matches(RUN_NAME, name) and name[0].isalpha(), name
    return name


def default_image(accelerator: str) -> str:
    """The train image `gaudi3 deploy render` refers to when --image is not given (built from the rendered
    Dockerfile; the Gaudi variant is built on Intel's Gaudi base image)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        tag = version("gaudi3-scale")
    except PackageNotFoundError:  # a source checkout that was never installed
        tag = "dev"
    tag = re.sub(r"[^A-Za-z0-9_.-]", "-", tag)  # a PEP 440 local version's `+` is not allowed in an image tag
    flavour = "gaudi" if accelerator.startswith("gaudi") else "cuda"
    return f"gaudi3-scale-train:{tag}-{flavour}"


def default_per_node(target: str, accelerator: str) -> int:
    """Accelerators per node: the catalog instance's for a cloud target (`deploy.instances` picks the instance),
    else 8 (8-device HGX / Gaudi OAM baseboards); ci: 1 (the repro tier's ranks; hosted runners have no accelerator)."""
    if target in ("aws", "azure", "gcp"):
        return instance_for(target, accelerator).accelerators_per_node
    return 1 if target == "ci" else 8
