"""The training pods, and the two ways to run them: a Kubeflow PyTorchJob, or an indexed Job without the operator.

Every pod runs the same launcher, `gaudi3 train`, with the geometry on its command line (the run config in the
ConfigMap stays the user's file): `--parallel.nnodes N --parallel.nproc_per_node P --parallel.node_rank R
--parallel.rdzv_endpoint MASTER:PORT`. Our launcher starts P workers with a c10d rendezvous hosted by node 0.
Only the node rank differs between pods, and Kubernetes fills it in by `$(VAR)` expansion: `PET_NODE_RANK`, set
by the training operator (master 0, worker i → i + 1), or the Job's completion index. The launcher does not read
the operator's `PET_*` rendezvous variables; the `elasticPolicy` rendered says the same thing for the operator.

Restarts. Our workers exit 143 / 138 (128 + SIGTERM / SIGUSR1) after a preemption checkpoint, and the launcher
passes that on (`distributed.launch.RESTARTABLE_EXIT_CODES`); 2 (bad input), 3 (cost budget reached) and 4
(paused by the spot policy) must not restart. The operator's `ExitCode` policy re-creates a pod only for 130, 137, 138 and 143
(kubeflow/training-operator `pkg/util/train/train_util.go` `IsRetryableExitCode`, release-1.9); the indexed Job
gets the same rule as a `podFailurePolicy`. Fixed size: our launcher runs a fixed `--nnodes` (the batch arithmetic
and sharded checkpoints assume one world size), so the elastic policy has minReplicas = maxReplicas.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from gaudi3_scale.deploy.k8s_options import JobPlan
from gaudi3_scale.deploy.node_command import (
    CONFIG_FILE,
    WORKSPACE,
    Deployment,
    Filled,
    NodeSlots,
    Slot,
    check_node_config,
    train_args,
)
from gaudi3_scale.deploy.quoting import k8s_literal

__all__ = [
    "CONFIG_DIR",
    "PYTORCHJOB_SCHEMA",
    "RETRYABLE_EXIT_CODES",
    "check_pod_config",
    "indexed_job",
    "pytorchjob",
]

PYTORCHJOB_SCHEMA = Path(__file__).parent / "schemas" / "pytorchjob-v1.schema.json"
RETRYABLE_EXIT_CODES = (130, 137, 138, 143)  # the training operator's retryable codes (module docstring)
CONFIG_DIR = str(PurePosixPath(CONFIG_FILE).parent)  # the ConfigMap's mount: run.yaml
CONTAINER = "pytorch"  # the training operator finds the training container by this name (PyTorchJobDefaultContainerName)
OPERATOR_PORT_NAME = "pytorchjob-port"  # its master Service exposes this port and sets MASTER_PORT to it


def _slots(plan: JobPlan, *, node_rank: str, rdzv_host: str) -> NodeSlots:
    """The pods' part of the node command. `node_rank` is a `$(VAR)` Kubernetes expands; every other value is
    literal."""
    extra: list[tuple[str, Slot]] = [("parallel.max_restarts", str(plan.max_restarts))]
    if plan.metrics_port is not None:  # 0.0.0.0: the default 127.0.0.1 cannot be scraped from outside the pod
        extra += [("monitor.metrics_port", str(plan.metrics_port)), ("monitor.metrics_host", "0.0.0.0")]
    return NodeSlots(
        node_rank=Filled(f"$({node_rank})", "0"),
        # one node meets on its own loopback (NodeSlots); a DNS name would make node 0 wait for its own record
        rdzv_endpoint=None if plan.nodes == 1 else f"{rdzv_host}:{plan.opts.rdzv_port}",
        nnodes=str(plan.nodes),
        nproc_per_node=str(plan.per_node),
        shared_out=plan.opts.storage == "pvc",  # emptydir: each pod its own --out
        extra=tuple(extra),
    )


def _word(slot: Slot) -> str:
    return slot.expr if isinstance(slot, Filled) else k8s_literal(slot)


def _train_args(plan: JobPlan, slots: NodeSlots) -> list[str]:
    return train_args(plan.name, slots, _word)


def check_pod_config(plan: JobPlan, run_config: dict[str, Any]) -> None:
    """The run config as a pod will resolve it (with its command-line overrides) must be valid, e.g. the global batch
    must split over nodes x per_node ranks: refused here in one line, not by every pod after it was scheduled."""
    deployment = Deployment(target="k8s", name=plan.name, nodes=plan.nodes, per_node=plan.per_node,
                            gaudi=plan.gaudi, run_config=run_config)  # fmt: skip
    check_node_config(deployment, _slots(plan, node_rank="PET_NODE_RANK", rdzv_host=_master(plan)))


def _master(plan: JobPlan) -> str:
    return f"{plan.name}-master-0"  # the operator's Service for the master pod, and MASTER_ADDR


def _env(plan: JobPlan, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    env = [
        # the c10d rendezvous id, equal on every pod
        {"name": "GAUDI3_RUN_ID", "value": k8s_literal(plan.name)},
        {"name": "GAUDI3_CACHE", "value": "/cache"},  # prepared data: pod-local scratch
        # The root filesystem is read-only: per-user caches (triton, matplotlib, torch inductor) go to /tmp.
        {"name": "HOME", "value": "/tmp"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},  # log lines reach `kubectl logs` as they are printed
    ]
    if plan.gaudi:
        # Habana's runtime logs to /var/log/habana_logs in a container (docs.habana.ai "Debugging with Intel Gaudi
        # Logs"), read-only here. Not yet validated on Gaudi hardware.
        env.append({"name": "HABANA_LOGS", "value": "/tmp/habana_logs"})
    return [*extra, *env]


def _resources(plan: JobPlan) -> dict[str, Any]:
    opts = plan.opts
    # requests = limits for every resource: Guaranteed QoS, so the kubelet's CPU manager may pin whole cores and the
    # pod is the last to be evicted; extended resources (accelerators, huge pages) must be equal anyway.
    amounts = {
        "cpu": opts.cpu or str(8 * plan.per_node),
        "memory": opts.memory or f"{64 * plan.per_node}Gi",
        plan.accelerator_resource: str(plan.per_node),
    }
    if plan.gaudi:
        amounts["hugepages-2Mi"] = (
            opts.hugepages_2mi
        )  # Habana docs' example pod; not yet validated on Gaudi hardware
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _volumes(plan: JobPlan) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container mounts)."""
    workspace: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": plan.workspace_claim}}
        if plan.opts.storage == "pvc"
        else {"emptyDir": {}}
    )
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": f"{plan.name}-config"}},
        {"name": "workspace", **workspace},
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "workspace", "mountPath": WORKSPACE},
        {"name": "cache", "mountPath": "/cache"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if not plan.gaudi:
        # Data-loader workers and NCCL pass tensors through /dev/shm, which is 64 MiB in a container by default.
        # (Gaudi pods share the host's IPC namespace instead.)
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": plan.opts.shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def _container(
    plan: JobPlan,
    image: str,
    *,
    args: list[str],
    env: list[dict[str, Any]],
    port_name: str,
    mounts: list[Any],
) -> dict[str, Any]:
    ports = [{"name": port_name, "containerPort": plan.opts.rdzv_port, "protocol": "TCP"}]
    if plan.metrics_port is not None:
        ports += [
            {"name": f"metrics-{i}", "containerPort": plan.metrics_port + i, "protocol": "TCP"}
            for i in range(plan.per_node)
        ]
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if plan.gaudi:
        capabilities["add"] = ["SYS_NICE"]  # Habana docs' example pod; not yet validated on Gaudi hardware
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["gaudi3"],
        "args": args,
        "workingDir": WORKSPACE,  # writable: relative paths in the run config land on the volume
        "env": _env(plan, env),
    }
    if plan.credentials_secret:
        # The backend's credentials as environment variables, from a Secret the user creates: never inlined here.
        secret_ref: dict[str, Any] = {"name": plan.credentials_secret}
        if plan.credentials_optional:
            secret_ref["optional"] = True
        container["envFrom"] = [{"secretRef": secret_ref}]
    # No probes, on purpose: a readiness probe would hide a pod from the rendezvous DNS until it passes, and a
    # liveness probe on /metrics (a background thread) stays green through a hung collective while a dead process is
    # already seen by the launcher; the Gaudi3TrainingStalled alert watches progress instead.
    return {
        **container,
        "ports": ports,
        "resources": _resources(plan),
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": capabilities,
        },
    }


def _pod_template(
    plan: JobPlan, image: str, *, args: list[str], env: list[dict[str, Any]], port_name: str, **pod: Any
) -> dict[str, Any]:
    volumes, mounts = _volumes(plan)
    container = _container(plan, image, args=args, env=env, port_name=port_name, mounts=mounts)
    uid = plan.opts.run_as_user
    gaudi = (
        {"hostIPC": True} if plan.gaudi else {}
    )  # Habana docs' example pod; not yet validated on Gaudi hardware
    spec: dict[str, Any] = {
        **pod,
        "serviceAccountName": plan.service_account,
        "automountServiceAccountToken": False,  # the pods call nothing on the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": plan.opts.grace_s,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": uid,
            "fsGroup": uid,  # the volume is writable by the pods' user
            "fsGroupChangePolicy": "OnRootMismatch",  # no recursive chown of a large volume at every start
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        **gaudi,
        "tolerations": [{"key": plan.accelerator_resource, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [container],
        "volumes": volumes,
    }
    metadata: dict[str, Any] = {"labels": dict(plan.labels)}
    if plan.metrics_port is not None:
        # Annotation-based discovery scrapes one port per pod (local rank 0); the PodMonitor scrapes every rank.
        metadata["annotations"] = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(plan.metrics_port),
            "prometheus.io/path": "/metrics",
        }
    return {"metadata": metadata, "spec": spec}


def pytorchjob(plan: JobPlan, image: str) -> dict[str, Any]:
    """The Kubeflow training operator's PyTorchJob (kubeflow.org/v1): Master 1, Worker nodes - 1."""
    master = _master(plan)
    template = _pod_template(
        plan,
        image,
        args=_train_args(plan, _slots(plan, node_rank="PET_NODE_RANK", rdzv_host=master)),
        env=[],
        port_name=OPERATOR_PORT_NAME,
    )
    replicas = {"Master": {"replicas": 1, "restartPolicy": "ExitCode", "template": template}}
    if plan.nodes > 1:
        replicas["Worker"] = {"replicas": plan.nodes - 1, "restartPolicy": "ExitCode", "template": template}
    spec: dict[str, Any] = {
        "nprocPerNode": str(plan.per_node),
        "runPolicy": {
            "cleanPodPolicy": "None",  # keep finished pods, so that their logs can be collected
            "backoffLimit": plan.opts.backoff_limit,
            "ttlSecondsAfterFinished": plan.opts.ttl_s,
        },
        "pytorchReplicaSpecs": replicas,
    }
    if plan.nodes > 1:  # the operator refuses an elastic policy without a Worker
        spec["elasticPolicy"] = {
            "rdzvBackend": "c10d",
            "rdzvHost": master,
            "rdzvPort": plan.opts.rdzv_port,
            "rdzvId": plan.name,
            "minReplicas": plan.nodes,
            "maxReplicas": plan.nodes,
            "maxRestarts": plan.max_restarts,
        }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": plan.name, "namespace": plan.namespace, "labels": dict(plan.labels)},
        "spec": spec,
    }


def indexed_job(plan: JobPlan, image: str) -> list[dict[str, Any]]:
    """Without the operator: a headless Service and one indexed Job; pod i is node i, pod 0 hosts the rendezvous."""
    # Pods of an indexed Job are named <job>-<index> and, with `subdomain`, resolve as <job>-<index>.<service>.
    master = f"{plan.name}-0.{plan.name}.{plan.namespace}.svc"
    node_rank = {
        "name": "NODE_RANK",
        "valueFrom": {
            "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
        },
    }
    template = _pod_template(
        plan,
        image,
        args=_train_args(plan, _slots(plan, node_rank="NODE_RANK", rdzv_host=master)),
        env=[node_rank],
        port_name="rdzv",
        restartPolicy="Never",  # the Job re-creates pods, under the failure policy below
        subdomain=plan.name,
    )
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": plan.name, "namespace": plan.namespace, "labels": dict(plan.labels)},
        "spec": {
            "clusterIP": "None",
            # DNS names exist before the pods are Ready: node 0 must be reachable while the rendezvous forms.
            "publishNotReadyAddresses": True,
            "selector": {"batch.kubernetes.io/job-name": plan.name},  # set on a Job's pods by Kubernetes
            "ports": [{"name": "rdzv", "port": plan.opts.rdzv_port, "targetPort": "rdzv", "protocol": "TCP"}],
        },
    }
    failure_policy = {
        "rules": [
            {  # any exit but the retryable ones fails the whole job at once (exit 0 is never matched)
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": CONTAINER,
                    "operator": "NotIn",
                    "values": list(RETRYABLE_EXIT_CODES),
                },
            },
            {  # a pod evicted or preempted by the cluster does not count against backoffLimit
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
        ]
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": plan.name, "namespace": plan.namespace, "labels": dict(plan.labels)},
        "spec": {
            "completionMode": "Indexed",
            "completions": plan.nodes,
            "parallelism": plan.nodes,
            "backoffLimit": plan.opts.backoff_limit,
            "podFailurePolicy": failure_policy,
            "ttlSecondsAfterFinished": plan.opts.ttl_s,
            "template": template,
        },
    }
    return [service, job]
