"""The Kubernetes target's options (`DeploySpec.extra`, keys below), and the plan every manifest is rendered from.

Every option has a default that renders a working job; `k8s_options(spec)` builds them with the config module's
`from_dict`, so a wrong key or type is one line naming `k8s.<field>` and the allowed keys. `plan_job` resolves the
defaults that depend on the run config (metrics port, restarts, the credentials Secret) and refuses what cannot work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from gaudi3_scale.config.core import check_positive, check_range, from_dict
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.deploy.containers import SCHEME_EXTRAS
from gaudi3_scale.deploy.grammar import check_dns_label, check_dns_subdomain, check_quantity
from gaudi3_scale.deploy.monitoring import DEFAULT_METRICS_PORT, metrics_port, monitoring_on
from gaudi3_scale.deploy.spec import DeploySpec, storage_urls
from gaudi3_scale.storage import url_protocol

__all__ = ["DEFAULT_METRICS_PORT", "JobPlan", "K8sOptions", "k8s_options", "plan_job"]

GAUDI_RESOURCE = "habana.ai/gaudi"  # Habana device plugin
GPU_RESOURCE = "nvidia.com/gpu"  # NVIDIA device plugin
# The options Kubernetes reads as bytes: each must carry a unit suffix (Gi, Mi, G, …).
BYTE_QUANTITIES = ("storage_size", "memory", "hugepages_2mi", "shm_size")


@dataclass(frozen=True, kw_only=True)
class K8sOptions:
    """The PyTorchJob's namespace, volume, credentials, pod resources, restarts and monitoring stack; every default
    renders a working job."""

    namespace: str | None = field(
        default=None, metadata={"help": "namespace to create and run in; null = the run name"}
    )
    storage: Literal["pvc", "emptydir"] = field(
        default="pvc",
        metadata={
            "help": "pvc: outputs and checkpoints on a ReadWriteMany volume shared by every pod; emptydir: pod-local "
            "scratch, allowed only with checkpoint.remote_url (the bucket is then the only durable copy)"
        },
    )
    storage_class: str | None = field(
        default=None,
        metadata={"help": "StorageClass of the volume (must offer ReadWriteMany); null = the default"},
    )
    # cpu may be a YAML number (--set cpu=16), kept as its text; a byte size (BYTE_QUANTITIES) needs its unit.
    storage_size: str | int | float = field(default="500Gi", metadata={"help": "size of the volume"})
    credentials_secret: str | None = field(
        default=None,
        metadata={
            "help": "Secret whose keys become the pods' environment (the storage backend's credentials, e.g. "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for s3://); null = <name>-checkpoint-credentials when "
            "checkpoint.remote_url is set, or (optional: pods start without it) when only a data or model URL is "
            "on s3://, gs:// or az://; '' = none (workload identity)"
        },
    )
    rdzv_port: int = field(default=29400, metadata={"help": "c10d rendezvous port on the master pod"})
    cpu: str | int | float | None = field(
        default=None, metadata={"help": "CPU request = limit per pod; null = 8 per accelerator"}
    )
    memory: str | int | float | None = field(
        default=None, metadata={"help": "memory request = limit per pod; null = 64Gi per accelerator"}
    )
    hugepages_2mi: str | int | float = field(
        default="95000Mi",
        metadata={"help": "Gaudi only: 2 MiB huge pages per pod (the Habana docs' example pod asks 95000Mi)"},
    )
    shm_size: str | int | float = field(
        default="64Gi", metadata={"help": "GPU only: size of the in-memory /dev/shm"}
    )
    max_restarts: int | None = field(
        default=None,
        metadata={"help": "worker-group restarts of the launcher; null = parallel.max_restarts, else 3"},
    )
    backoff_limit: int = field(default=3, metadata={"help": "pod re-creations before the job fails"})
    grace_s: int = field(
        default=120,
        metadata={"help": "seconds between SIGTERM and SIGKILL: time for the preemption checkpoint"},
    )
    ttl_s: int = field(
        default=7 * 24 * 3600,
        metadata={"help": "seconds a finished job (and its pods' logs) is kept before it is deleted"},
    )
    run_as_user: int = field(
        default=10001,
        metadata={"help": "UID and GID the pods run as (the rendered Dockerfile's user, 10001)"},
    )
    monitoring: bool | None = field(
        default=None,
        metadata={
            "help": "render the monitoring stack under k8s/monitoring/ (kube-prometheus-stack values, PodMonitor, "
            "alert rules, dashboard, Alertmanager routing); null = when the run config sets monitor.metrics_port"
        },
    )
    monitoring_namespace: str = field(
        default="monitoring",
        metadata={
            "help": "namespace of the kube-prometheus-stack release; the alert rules and dashboard go there"
        },
    )
    grafana_admin_secret: str = field(
        default="grafana-admin",
        metadata={
            "help": "Secret in monitoring_namespace with Grafana's admin-user and admin-password (never rendered)"
        },
    )
    alert_webhook_secret: str = field(
        default="gaudi3-alert-webhook",
        metadata={
            "help": "Secret in the run's namespace whose key `url` is the alert webhook (never rendered)"
        },
    )

    def __post_init__(self) -> None:
        # Each value is written into the manifests: held to its Kubernetes grammar (deploy/grammar.py).
        if self.namespace is not None:
            check_dns_label(self.namespace, "namespace")
        if self.storage_class is not None:
            check_dns_subdomain(self.storage_class, "storage_class")
        if self.credentials_secret:  # '' = none
            check_dns_subdomain(self.credentials_secret, "credentials_secret")
        check_dns_label(self.monitoring_namespace, "monitoring_namespace")
        check_dns_subdomain(self.grafana_admin_secret, "grafana_admin_secret")
        check_dns_subdomain(self.alert_webhook_secret, "alert_webhook_secret")
        for name in ("storage_size", "cpu", "memory", "hugepages_2mi", "shm_size"):
            value = getattr(self, name)
            if value is not None:
                text = check_quantity(value, name)
                # the API server refuses a volume claim of size 0; a 0 CPU or memory limit never schedules
                number = re.sub(r"[^0-9.].*", "", text)
                if float(number or 0) == 0:
                    raise ConfigError(name, f"must be more than 0, got {text}")
                if name in BYTE_QUANTITIES and not re.search(r"[KMGTPE]i?$|k$", text):
                    # Kubernetes reads a bare number as bytes: a 500-byte volume, a 64-byte /dev/shm
                    raise ConfigError(name, f"{text} is {text} bytes; write e.g. {number}Gi")
                object.__setattr__(self, name, text)
        check_range("rdzv_port", self.rdzv_port, 1, 65535)
        check_positive("max_restarts", self.max_restarts, allow_zero=True)
        check_positive("backoff_limit", self.backoff_limit, allow_zero=True)
        check_positive("grace_s", self.grace_s)
        check_positive("ttl_s", self.ttl_s, allow_zero=True)
        check_positive("run_as_user", self.run_as_user)


def k8s_options(spec: DeploySpec) -> K8sOptions:
    return from_dict(K8sOptions, spec.extra, prefix="k8s")


@dataclass(frozen=True, kw_only=True)
class JobPlan:
    """The resolved settings every manifest is rendered from."""

    name: str
    namespace: str
    labels: dict[str, str]
    nodes: int
    per_node: int
    gaudi: bool
    metrics_port: int | None  # the first of a pod's Prometheus ports; None = no metrics endpoint
    monitoring: bool  # render k8s/monitoring/ (k8s_monitoring.py)
    max_restarts: int
    credentials_secret: str  # "" = none
    # the pods start without the Secret: defaulted only for data or model URLs, which workload identity may serve
    credentials_optional: bool
    opts: K8sOptions

    @property
    def accelerator_resource(self) -> str:
        return GAUDI_RESOURCE if self.gaudi else GPU_RESOURCE

    @property
    def workspace_claim(self) -> str:
        return f"{self.name}-workspace"

    @property
    def service_account(self) -> str:
        return f"{self.name}-trainer"


def plan_job(spec: DeploySpec, opts: K8sOptions) -> JobPlan:
    if not spec.name[0].isalpha():
        # PyTorchJob names are DNS-1035 labels (the operator's webhook), and so are the Services named after them.
        raise UserInputError(f"the run name {spec.name!r} must start with a letter to name Kubernetes jobs")
    cfg = spec.run_config
    remote_url = cfg["checkpoint"]["remote_url"]
    if opts.storage == "emptydir" and not remote_url:
        raise UserInputError(
            "k8s.storage: emptydir loses every checkpoint with its pod; set checkpoint.remote_url or use pvc"
        )
    port = metrics_port(
        cfg["monitor"]["metrics_port"], spec.per_node, rdzv_port=opts.rdzv_port, rdzv_field="k8s.rdzv_port"
    )
    secret, optional = opts.credentials_secret, False
    if secret is None:
        # the pods open every bucket the run config names: the checkpoint mirror, and data or a model on a cloud
        # store (s3fs, gcsfs and adlfs read their credentials from the environment the Secret fills). For data or
        # a model only, the Secret is optional: pods that read through workload identity (IRSA, GKE Workload
        # Identity) start without it instead of waiting in CreateContainerConfigError.
        stores = [url for _, url in storage_urls(cfg) if SCHEME_EXTRAS.get(url_protocol(url) or "")]
        secret = f"{spec.name}-checkpoint-credentials" if remote_url or stores else ""
        optional = bool(stores) and not remote_url
    restarts = opts.max_restarts
    if restarts is None:
        restarts = cfg["parallel"]["max_restarts"] or 3  # a multi-pod job must survive a lost pod by default
    return JobPlan(
        name=spec.name,
        namespace=opts.namespace or spec.name,
        labels={
            "app.kubernetes.io/name": "gaudi3-scale",
            "app.kubernetes.io/instance": spec.name,
            "app.kubernetes.io/component": "trainer",
        },
        nodes=spec.nodes,
        per_node=spec.per_node,
        gaudi=spec.accelerator.startswith("gaudi"),
        metrics_port=port,
        monitoring=monitoring_on(opts.monitoring, port, "k8s.monitoring"),
        max_restarts=restarts,
        credentials_secret=secret,
        credentials_optional=optional,
        opts=opts,
    )
