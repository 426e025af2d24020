"""What a deployment is rendered from: the target, the accelerator, the node count and the run config."""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.deploy.grammar import RUN_NAME, check_host, check_image, check_region, matches
from gaudi3_scale.deploy.instances import ACCELERATORS, instance_for
from gaudi3_scale.metering.catalog import Instance
from gaudi3_scale.storage import url_protocol

__all__ = [
    "ACCELERATORS",
    "BUCKET_SCHEMES",
    "CLOUDS",
    "TARGETS",
    "DeploySpec",
    "check_per_node",
    "gaudi_run_config",
    "gpu_run_config",
    "resource_name",
    "storage_urls",
]

TARGETS = ("aws", "azure", "gcp", "onprem", "k8s", "ci")
CLOUDS = ("aws", "azure", "gcp")  # the Terraform targets: they rent a catalog instance (`deploy.instances`)
# The scheme of the checkpoint bucket each cloud target creates (its Terraform's `local.checkpoint_url`), which
# every node gets as --checkpoint.remote_url.
BUCKET_SCHEMES = {"aws": "s3", "gcp": "gs", "azure": "az"}
# The run config's fields that may name a storage URL a node opens (fsspec). data.source (and a mixture member's)
# may list several sources, comma-separated.
STORAGE_URL_FIELDS = (
    "data.source",
    "data.prepared_dir",
    "data.cache_dir",
    "model.init_from",
    "checkpoint.remote_url",
)


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
        # frozen: the resolved run config is replaced once, here, before any renderer reads it
        if self.accelerator.startswith("gaudi"):
            object.__setattr__(self, "run_config", gaudi_run_config(self.accelerator, self.run_config))
        else:
            object.__setattr__(
                self, "run_config", gpu_run_config(self.target, self.accelerator, self.run_config)
            )
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
        if self.target in CLOUDS:
            self._check_instance()

    def _check_instance(self) -> None:
        """What the Terraform rents must hold what the run asks: --per-node ranks, and `cost.*` metering the
        instance and capacity that are rendered (a budget or a spot pause acting on another price stops the run at
        the wrong time)."""
        instance = check_per_node(self.target, self.accelerator, self.per_node)
        cost = self.run_config.get("cost") or {}
        rendered = f"{self.target}/{instance.type}"
        wanted = cost.get("instance")
        if wanted and "/".join(str(wanted).split("/")[:2]) != rendered:
            raise ConfigError(
                "cost.instance",
                f"{brief(wanted)} is not what --target {self.target} --accelerator {self.accelerator} renders "
                f"({rendered}/<region>); set it to that instance, or null",
            )
        pricing = cost.get("pricing", "on_demand")
        if pricing != "on_demand":
            raise ConfigError(
                "cost.pricing",
                f"{brief(pricing)}, but --target {self.target} renders on-demand instances; allowed: on_demand",
            )

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


def check_per_node(target: str, accelerator: str, per_node: int) -> Instance:
    """The catalog instance a cloud target rents, refused in one line when it has fewer accelerators than
    --per-node asks ranks (the extra ranks would share devices or find none)."""
    instance = instance_for(target, accelerator)
    if per_node > instance.accelerators_per_node:
        raise UserInputError(
            f"--per-node: {per_node} ranks per node, but --target {target} --accelerator {accelerator} rents "
            f"{instance.type} with {instance.accelerators_per_node} accelerators; allowed: "
            f"1-{instance.accelerators_per_node}"
        )
    return instance


GPU_DEVICES = ("auto", "cuda")


def gpu_run_config(target: str, accelerator: str, run_config: dict[str, Any]) -> dict[str, Any]:
    """The run config an NVIDIA deployment trains with: `train.device` cuda (auto is rendered as cuda, as a node
    whose GPUs are not visible at start would otherwise train on its CPUs); cpu and hpu are refused, as
    `gaudi_run_config` refuses cpu and cuda. The ci target is the exception: its repro tier runs on a hosted
    runner (no GPU) unless ci.repro_runs_on names one, so there auto stays auto and cpu is allowed."""
    device = run_config.get("train", {}).get("device", "auto")
    allowed = ("auto", "cuda", "cpu") if target == "ci" else GPU_DEVICES
    if device not in allowed:
        rendered = "" if target == "ci" else " (rendered as cuda)"
        raise ConfigError(
            "train.device",
            f"{brief(device)} in an NVIDIA deployment (--accelerator {accelerator}, --target {target}); "
            f"allowed: {', '.join(allowed)}{rendered}",
        )
    if target == "ci" or device == "cuda":
        return run_config
    pinned = copy.deepcopy(run_config)
    pinned.setdefault("train", {})["device"] = "cuda"
    return pinned


def storage_urls(run_config: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, URL) for every storage URL (`PROTOCOL://…`) of the run config that a node opens, in
    STORAGE_URL_FIELDS order, then data.mixture's members (`data.mixture[i].source`)."""
    found: list[tuple[str, str]] = []

    def add(name: str, value: Any) -> None:
        for part in str(value or "").split(",") if name.endswith("source") else [value]:
            if isinstance(part, str) and url_protocol(part.strip()) is not None:
                found.append((name, part.strip()))

    for dotted in STORAGE_URL_FIELDS:
        section, key = dotted.split(".")
        add(dotted, (run_config.get(section) or {}).get(key))
    for i, member in enumerate((run_config.get("data") or {}).get("mixture") or []):
        add(f"data.mixture[{i}].source", member.get("source") if isinstance(member, dict) else None)
    return found


def url_bucket(url: str) -> str:
    """The bucket (container) of a storage URL: its authority."""
    return urlsplit(url).netloc


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
    if target in CLOUDS:
        return instance_for(target, accelerator).accelerators_per_node
    return 1 if target == "ci" else 8
