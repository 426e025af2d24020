"""`gaudi3 deploy render --target k8s`: the manifests of one training run, under `k8s/`.

    k8s/README.md                  how to apply them, and what each setting is for
    k8s/base/00-namespace.yaml     Namespace (Pod Security labels)
    k8s/base/01-rbac.yaml          ServiceAccount, Role and RoleBinding: least privilege, which here is nothing
    k8s/base/02-config.yaml        ConfigMap: the resolved run config, mounted as /etc/gaudi3/run.yaml
    k8s/base/03-storage.yaml       PersistentVolumeClaim (ReadWriteMany) for outputs and checkpoints (k8s.storage=pvc)
    k8s/pytorchjob.yaml            the job, for clusters with the Kubeflow training operator …
    k8s/indexed-job.yaml           … or the same job as a headless Service + indexed Job, without it (pick one)
    k8s/monitoring/…               the monitoring stack: kube-prometheus-stack values, PodMonitor, alert rules …

The pods and the two job flavours are in `k8s_job.py`, the monitoring stack in `k8s_monitoring.py`, the options
(`DeploySpec.extra`) in `k8s_options.py`. Nothing here needs a cluster: the tests validate every manifest offline
against the Kubernetes OpenAPI schemas (kubernetes-validate) and the custom resources against our schemas in
`schemas/`.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import yaml

from gaudi3_scale.deploy.k8s_job import (
    CONFIG_DIR,
    RETRYABLE_EXIT_CODES,
    check_pod_config,
    indexed_job,
    pytorchjob,
)
from gaudi3_scale.deploy.k8s_monitoring import (
    MONITORING_FILES,
    monitoring_manifests,
    monitoring_readme,
    stack_values_text,
)
from gaudi3_scale.deploy.k8s_options import JobPlan, K8sOptions, k8s_options, plan_job
from gaudi3_scale.deploy.quoting import comment, sh_quote, yaml_text
from gaudi3_scale.deploy.render import register_renderer
from gaudi3_scale.deploy.spec import DeploySpec

__all__ = ["FILES", "pod_security_level", "render_k8s"]

FILES = {
    "namespace": "k8s/base/00-namespace.yaml",
    "rbac": "k8s/base/01-rbac.yaml",
    "config": "k8s/base/02-config.yaml",
    "storage": "k8s/base/03-storage.yaml",
    "pytorchjob": "k8s/pytorchjob.yaml",
    "indexed": "k8s/indexed-job.yaml",
    "readme": "k8s/README.md",
    **MONITORING_FILES,
}
GAUDI_NOTE = (
    "Gaudi settings (hostIPC, SYS_NICE, hugepages-2Mi, HABANA_LOGS): not yet validated on Gaudi hardware."
)
# capabilities.add SYS_NICE (k8s_job) and --cap-add sys_nice (bootstrap) copy Habana's example pod, but the image
# runs as UID 10001: a non-root process gets no effective capability from the bounding set unless it is ambient,
# and neither Kubernetes (kubernetes/kubernetes#56374) nor Docker sets ambient capabilities.
SYS_NICE_NOTE = [
    "SYS_NICE is added as Habana's example pod does, but it has no effect for the non-root UID the pods run as",
    "(Kubernetes sets no ambient capabilities); whether Gaudi training needs it is not validated on Gaudi hardware.",
]


def render_k8s(spec: DeploySpec) -> dict[str, str]:
    plan = plan_job(spec, k8s_options(spec))
    check_pod_config(plan, spec.run_config)
    what = f"{spec.config_path.name} ({spec.accelerator} x {spec.nodes})"
    notes = [f"Rendered by `gaudi3 deploy render --target k8s` from {what}."] + (
        [GAUDI_NOTE] if plan.gaudi else []
    )
    files = {
        FILES["namespace"]: _dump(
            [_namespace(plan)],
            [*notes, *(psa_operator_note(plan) if pod_security_level(plan) == "baseline" else [])],
        ),
        FILES["rbac"]: _dump(_rbac(plan), [*notes, *_RBAC_NOTE]),
        FILES["config"]: _dump([_config_map(plan, spec)], notes),
        FILES["pytorchjob"]: _dump([pytorchjob(plan, spec.image)], [*notes, *_PYTORCHJOB_NOTE]),
        FILES["indexed"]: _dump(indexed_job(plan, spec.image), [*notes, *_INDEXED_NOTE]),
        FILES["readme"]: _readme(plan, spec),
    }
    if plan.monitoring:
        for rel, (documents, more) in monitoring_manifests(plan).items():
            files[rel] = _dump(documents, [*notes, *more])
        files[FILES["values"]] = stack_values_text(plan, notes)
    if plan.opts.storage == "pvc":
        files[FILES["storage"]] = _dump([_volume_claim(plan)], [*notes, *_STORAGE_NOTE])
    return dict(sorted(files.items()))


_RBAC_NOTE = [
    "The training pods call nothing on the API server: the rendezvous is c10d over pod DNS, checkpoints go to the",
    "volume or the bucket, metrics are scraped. So the Role grants nothing (it is where a reviewed grant would go)",
    "and the pods do not even mount a token (automountServiceAccountToken: false).",
]
_PYTORCHJOB_NOTE = [
    "Needs the Kubeflow training operator (PyTorchJob v1, release-1.9). Apply this file OR indexed-job.yaml.",
    f"restartPolicy ExitCode: the operator re-creates a pod that exits {', '.join(map(str, RETRYABLE_EXIT_CODES))};",
    "any other exit (2 bad input, 3 cost budget, 4 spot pause) fails the job.",
]
_INDEXED_NOTE = [
    "Without the training operator: a headless Service and an indexed Job. Apply this file OR pytorchjob.yaml.",
    "Pod i is node i (JOB_COMPLETION_INDEX); pod 0 hosts the c10d rendezvous.",
]
_STORAGE_NOTE = [
    "Every pod writes its checkpoint shards into one directory, and a re-created pod resumes from it on any node:",
    "the class must offer ReadWriteMany (NFS, CephFS, EFS, Filestore, Azure Files ...).",
]


def _meta(plan: JobPlan, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": plan.namespace, "labels": dict(plan.labels)}


# Why a multi-node GPU namespace enforces "baseline", not "restricted": for every Worker pod of a PyTorchJob with a
# Master, training-operator v1.9 injects an `init-pytorch` init container (alpine, `nslookup <job>-master-0`;
# pkg/controller.v1/pytorch/initcontainer.go) with no securityContext. "restricted" checks init containers too
# (allowPrivilegeEscalation, capabilities), so it would reject every Worker pod and the Master would wait for them
# until its rendezvous timeout. Our own containers still meet "restricted" (the warn and audit levels say so).
# The indexed Job involves no operator, but the Namespace is one object in k8s/base that both job files share: a
# level per job file would have a later `kubectl apply -f k8s/base` revoke what the PyTorchJob's re-created Worker
# pods need. So the shared Namespace enforces "baseline", and the note says how to tighten it for the indexed Job.
def psa_operator_note(plan: JobPlan) -> list[str]:
    return [
        "Pod Security: enforce baseline, warn and audit restricted. The training operator (v1.9) adds an",
        "`init-pytorch` init container without a securityContext to every Worker pod, which restricted would reject;",
        "the job's own containers meet restricted. If you apply indexed-job.yaml instead (no operator), restricted",
        f"suffices: kubectl label namespace {sh_quote(plan.namespace)} "
        "pod-security.kubernetes.io/enforce=restricted --overwrite",
    ]


def pod_security_level(plan: JobPlan) -> str:
    """The Pod Security Standard the namespace enforces. GPU pods meet "restricted"; a multi-node GPU job gets
    "baseline" (psa_operator_note). Gaudi pods need hostIPC and SYS_NICE (Habana's example pod), which even
    "baseline" forbids, so that namespace enforces nothing; every namespace warns and audits at "restricted"."""
    if plan.gaudi:
        return "privileged"
    return "baseline" if plan.nodes > 1 else "restricted"


def _namespace(plan: JobPlan) -> dict[str, Any]:
    enforce = pod_security_level(plan)
    labels = {
        **plan.labels,
        "pod-security.kubernetes.io/enforce": enforce,
        "pod-security.kubernetes.io/warn": "restricted",
        "pod-security.kubernetes.io/audit": "restricted",
    }
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": plan.namespace, "labels": labels}}


def _rbac(plan: JobPlan) -> list[dict[str, Any]]:
    name = plan.service_account
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _meta(plan, name),
            "automountServiceAccountToken": False,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(plan, name),
            "rules": [],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(plan, name),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": plan.namespace}],
        },
    ]


def _config_map(plan: JobPlan, spec: DeploySpec) -> dict[str, Any]:
    text = yaml_text(spec.run_config)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(plan, f"{plan.name}-config"),
        "data": {"run.yaml": text},
    }


def _volume_claim(plan: JobPlan) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": plan.opts.storage_size}},
    }
    if plan.opts.storage_class:
        spec["storageClassName"] = plan.opts.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(plan, plan.workspace_claim),
        "spec": spec,
    }


def _dump(documents: list[dict[str, Any]], notes: list[str]) -> str:
    """The notes as comments, then the documents (yaml_text writes no anchors: the Master and Worker templates
    are written out in full, as a reader expects)."""
    head = "".join(f"# {comment(line)}\n" for line in notes)
    return head + "---\n".join(yaml_text(doc) for doc in documents)


def _readme(plan: JobPlan, spec: DeploySpec) -> str:
    storage = (
        f"the ReadWriteMany volume `{plan.workspace_claim}`"
        if plan.opts.storage == "pvc"
        else "pod-local scratch; the bucket in checkpoint.remote_url is the only durable copy"
    )
    apply_monitoring = (
        ["kubectl apply -f k8s/monitoring/         # the monitoring stack: see Monitoring below"]
        if plan.monitoring
        else []
    )
    if plan.metrics_port is not None:
        metrics = [
            f"- Metrics: rank r of a pod serves Prometheus metrics on port {plan.metrics_port} + its local rank,",
            "  bound to 0.0.0.0; the prometheus.io annotations name local rank 0"
            + (", the PodMonitor every rank." if plan.monitoring else "."),
        ]
    else:
        metrics = [
            "- Metrics: off. Set monitor.metrics_port in the run config (the image then includes prometheus-client)",
            "  to get per-rank ports, scrape annotations and a PodMonitor.",
        ]
    lines = [
        f"# Kubernetes: {plan.name} ({spec.accelerator}, {plan.nodes} node(s) x {plan.per_node} per node)",
        "",
        "Apply the base, then ONE of the two job files:",
        "",
        "```",
        "kubectl apply -f k8s/base/",
        "kubectl apply -f k8s/pytorchjob.yaml     # with the Kubeflow training operator (PyTorchJob v1)",
        "kubectl apply -f k8s/indexed-job.yaml    # or: plain Kubernetes >= 1.27 (indexed Job + headless Service)",
        *apply_monitoring,
        "```",
        "",
        f"- Image: `{spec.image}`, run as UID {plan.opts.run_as_user} with a read-only root filesystem.",
        f"- Run config: ConfigMap `{plan.name}-config`, mounted as `{CONFIG_DIR}/run.yaml`; the pods' command line",
        "  adds the launch geometry (nodes, ranks per node, node rank, rendezvous) and the metrics address.",
        f"- Outputs and checkpoints: `/workspace/runs/{plan.name}` on {storage}.",
        *metrics,
        "- Benchmark results (benchmark.result: true) are read from the pods' logs:",
        f"  `gaudi3 deploy collect --job {sh_quote(plan.name)} --namespace {sh_quote(plan.namespace)} --out results/`.",
        "- Restarts: a pod that exits 143 or 138 (preempted, after a checkpoint) is re-created and resumes from the",
        "  last checkpoint; 2 (bad input), 3 (cost budget reached) and 4 (spot pause) end the job. The launcher",
        f"  restarts its workers up to {plan.max_restarts} times. Known limit: if the pod of node 0 (the rendezvous",
        "  host) is lost alone, the other pods may fail with it; apply the job again to resume from the checkpoint.",
    ]
    if plan.credentials_secret:
        lines += [
            "",
            "The buckets' credentials (checkpoint.remote_url, data and model URLs) come from the Secret",
            f"`{plan.credentials_secret}`: its keys become environment variables of the pods. It is never rendered;",
            "create it yourself, e.g. for s3://",
            "",
            "```",
            f"kubectl -n {sh_quote(plan.namespace)} create secret generic {sh_quote(plan.credentials_secret)} \\",
            "  --from-literal=AWS_ACCESS_KEY_ID=<key-id> --from-literal=AWS_SECRET_ACCESS_KEY=<secret-key>",
            "```",
        ]
    if plan.credentials_optional:
        lines += [
            "",
            "The Secret is optional here (only data or model URLs need it, no checkpoint.remote_url): pods that read",
            "through workload identity (IRSA, GKE Workload Identity) start without it. `--set credentials_secret=''`",
            "drops the reference.",
        ]
    if plan.monitoring:
        lines += monitoring_readme(plan)
    lines += _options_readme(plan)
    if pod_security_level(plan) == "baseline":
        lines += ["", *psa_operator_note(plan)]
    if plan.gaudi:
        lines += ["", GAUDI_NOTE, *SYS_NICE_NOTE]
    return "\n".join(lines) + "\n"


def _options_readme(plan: JobPlan) -> list[str]:
    """The options this render took (`--set KEY=VALUE`), each with its value and what it is for: the
    K8sOptions fields' help, the one home of that text."""
    lines = [
        "",
        "## Options",
        "",
        "Change one with `gaudi3 deploy render ... --set KEY=VALUE` and render again.",
        "",
    ]
    for f in fields(K8sOptions):
        # as --set reads it back (YAML): null, true, '', 500Gi
        shown = yaml.safe_dump(getattr(plan.opts, f.name)).removesuffix("...\n").strip()
        lines.append(f"- `{f.name}` = `{shown}`: {f.metadata.get('help', '')}")
    return lines


register_renderer("k8s", render_k8s, options=K8sOptions)
