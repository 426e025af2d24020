"""`gaudi3 deploy render --target k8s` and `deploy.collect`, offline.

Every rendered manifest is validated against the Kubernetes OpenAPI schemas bundled by kubernetes-validate (strict:
unknown fields fail), the custom resources against our schemas (`deploy/schemas/`: PyTorchJob, and the monitoring
stack's, tested further in test_deploy_monitoring.py) and the PyTorchJob's pod templates as Kubernetes
PodTemplates; the pods' command line is run through `gaudi3 train --print-config`.

Golden files: `tests/golden/deploy/k8s/<case>/`. After a deliberate change, regenerate them and review the diff:

    GAUDI3_UPDATE_GOLDEN=1 .venv/bin/pytest tests/unit/test_deploy_k8s.py
"""

from __future__ import annotations

import copy
import io
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gaudi3_scale.bench.result import cell_section, failed_result, print_result, write_result
from gaudi3_scale.bench.schema import load_result
from gaudi3_scale.config.core import to_dict
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.deploy.collect import collect_pod_logs, collect_results, kubectl_logs
from gaudi3_scale.deploy.k8s_job import PYTORCHJOB_SCHEMA, RETRYABLE_EXIT_CODES
from gaudi3_scale.deploy.k8s_monitoring import SCHEMAS as MONITORING_SCHEMAS
from gaudi3_scale.deploy.kubernetes import FILES, render_k8s
from gaudi3_scale.deploy.spec import DeploySpec
from gaudi3_scale.distributed.launch import RESTARTABLE_EXIT_CODES
from gaudi3_scale.distributed.plan import BatchPlan
from gaudi3_scale.metering.live import BUDGET_EXIT_CODE, SPOT_PAUSE_EXIT_CODE
from gaudi3_scale.train.config import resolve_config

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden" / "deploy" / "k8s"
K8S_VERSION = "1.30"  # the oldest release kubernetes-validate bundles that has every field we use
CRDS = {"PyTorchJob", "PodMonitor", "PrometheusRule", "AlertmanagerConfig"}  # validated by their schemas
TINY = """\
name: tiny-k8s
model:
  num_layers: 1
train:
  global_batch_size: 96  # splits over every geometry below: 8, 16, 24 and 32 ranks
  max_steps: 20
  log_every_steps: 5
"""
CASES = {  # golden case → (accelerator, nodes, per node, image, run config overrides)
    "gaudi3-x2": ("gaudi3", 2, 8, "registry.example/gaudi3-scale-train:0.1.0-gaudi", ("--monitor.metrics_port", "9100")),
    "h100-x1": ("h100", 1, 8, "registry.example/gaudi3-scale-train:0.1.0-cuda", ()),
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("k8s") / "run.yaml"
    path.write_text(TINY)
    return path


def _spec(
    config: Path, accelerator: str = "gaudi3", nodes: int = 2, *overrides: str, **kw: Any
) -> DeploySpec:
    cfg = resolve_config(str(config), list(overrides))
    args: dict[str, Any] = {"per_node": 8, "image": "registry.example/train:1", **kw}
    return DeploySpec(target="k8s", accelerator=accelerator, nodes=nodes, config_path=config,
                      run_config=to_dict(cfg), name=cfg.name, **args)  # fmt: skip


def _docs(files: dict[str, str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every Kubernetes object rendered (not the Helm values of the monitoring stack)."""
    for rel, text in files.items():
        if rel.endswith(".yaml") and rel != FILES["values"]:
            for doc in yaml.safe_load_all(text):
                yield rel, doc


def _kind(files: dict[str, str], kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in _docs(files) if doc["kind"] == kind]


def _pod_specs(files: dict[str, str]) -> list[dict[str, Any]]:
    """The pod spec of every replica type of the PyTorchJob and of the indexed Job."""
    (job,) = _kind(files, "PyTorchJob")
    specs = [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    return specs + [j["spec"]["template"]["spec"] for j in _kind(files, "Job")]


@pytest.fixture(scope="module")
def pytorchjob_schema() -> dict[str, Any]:
    schema = json.loads(PYTORCHJOB_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


# ---- goldens ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_files(case: str, tiny_config: Path) -> None:
    accelerator, nodes, per_node, image, overrides = CASES[case]
    files = render_k8s(_spec(tiny_config, accelerator, nodes, *overrides, per_node=per_node, image=image))
    assert set(files) >= {FILES["pytorchjob"], FILES["indexed"], FILES["config"], FILES["readme"]}
    root = GOLDEN_DIR / case
    if os.environ.get("GAUDI3_UPDATE_GOLDEN") == "1":
        if root.exists():
            shutil.rmtree(root)
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
    golden = {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*") if p.is_file()}
    assert sorted(files) == sorted(golden), "rendered file set changed (GAUDI3_UPDATE_GOLDEN=1 to regenerate)"
    for rel, text in files.items():
        assert text == golden[rel], (
            f"{rel} differs from its golden file (GAUDI3_UPDATE_GOLDEN=1 to regenerate)"
        )


# ---- schemas --------------------------------------------------------------------------------------------------


VARIANTS = {
    "gaudi3-x2": ("gaudi3", 2, ("--monitor.metrics_port", "9100"), {}),
    "h100-x1": ("h100", 1, (), {}),
    "gaudi2-x4-bucket-only": ("gaudi2", 4, ("--checkpoint.remote_url", "s3://bucket/ckpt"), {"storage": "emptydir"}),
    "a100-x3-options": ("a100", 3, ("--monitor.metrics_port", "9200"),
                        {"storage_class": "nfs-rwx", "cpu": "48", "memory": "700Gi", "namespace": "research"}),
}  # fmt: skip


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_manifest_validates(variant: str, tiny_config: Path, pytorchjob_schema: dict[str, Any]) -> None:
    accelerator, nodes, overrides, extra = VARIANTS[variant]
    files = render_k8s(_spec(tiny_config, accelerator, nodes, *overrides, extra=extra))
    kinds = set()
    for _, doc in _docs(files):
        kinds.add(doc["kind"])
        if doc["kind"] not in CRDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        elif doc["kind"] in MONITORING_SCHEMAS:
            jsonschema.validate(doc, json.loads(MONITORING_SCHEMAS[doc["kind"]].read_text()))
    expected = {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "PyTorchJob", "Service", "Job",
                "PodMonitor", "PrometheusRule", "AlertmanagerConfig", "PersistentVolumeClaim"}  # fmt: skip
    if extra.get("storage") == "emptydir":
        expected.remove("PersistentVolumeClaim")
    if (
        "--monitor.metrics_port" not in overrides
    ):  # no metrics, no monitoring stack (test_deploy_monitoring.py)
        expected -= {"PodMonitor", "PrometheusRule", "AlertmanagerConfig"}
    assert kinds == expected
    (job,) = _kind(files, "PyTorchJob")
    jsonschema.validate(job, pytorchjob_schema)
    # The CRD embeds pod templates: validate them as Kubernetes PodTemplates.
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": replica["template"],
        }
        kubernetes_validate.validate(template, K8S_VERSION, strict=True)
    port_names = {p["name"] for spec in _pod_specs(files) for c in spec["containers"] for p in c["ports"]}
    for monitor in _kind(files, "PodMonitor"):
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= port_names
    namespaces = {doc["metadata"].get("namespace") for _, doc in _docs(files) if doc["kind"] != "Namespace"}
    # The alert rules and the dashboard serve every run from the monitoring stack's namespace.
    shared = {"monitoring"} if "PrometheusRule" in kinds else set()
    assert namespaces == {extra.get("namespace", "tiny-k8s"), *shared}


def test_a_broken_pytorchjob_fails_the_schema(tiny_config: Path, pytorchjob_schema: dict[str, Any]) -> None:
    (good,) = _kind(render_k8s(_spec(tiny_config, "gaudi3", 3)), "PyTorchJob")
    jsonschema.validate(good, pytorchjob_schema)

    def broken(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        job = copy.deepcopy(good)
        change(job)
        return job

    replicas = lambda job: job["spec"]["pytorchReplicaSpecs"]  # noqa: E731
    breaks = {
        "container not named pytorch": lambda j: replicas(j)["Worker"]["template"]["spec"]["containers"][0].update(name="trainer"),
        "replicas missing": lambda j: replicas(j)["Worker"].pop("replicas"),
        "two masters": lambda j: replicas(j)["Master"].update(replicas=2),
        "unknown restart policy": lambda j: replicas(j)["Master"].update(restartPolicy="OnExitCode"),
        "unknown replica type": lambda j: replicas(j).update(Chief=replicas(j)["Master"]),
        "elastic without a worker": lambda j: replicas(j).pop("Worker"),
        "nProcPerNode with nprocPerNode": lambda j: j["spec"]["elasticPolicy"].update(nProcPerNode=8),
        "bad nprocPerNode": lambda j: j["spec"].update(nprocPerNode=8),
        "unknown runPolicy field": lambda j: j["spec"]["runPolicy"].update(cleanPodPolicies="None"),
        "wrong apiVersion": lambda j: j.update(apiVersion="kubeflow.org/v2"),
        "name not DNS-1035": lambda j: j["metadata"].update(name="1job"),
    }  # fmt: skip
    for what, change in breaks.items():
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken(change), pytorchjob_schema)
            pytest.fail(f"{what}: passed the schema")


def test_a_typo_in_a_pod_template_fails_kubernetes_validate(tiny_config: Path) -> None:
    (job,) = _kind(render_k8s(_spec(tiny_config)), "Job")
    job["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


# ---- what the job does ----------------------------------------------------------------------------------------


def _container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_spec["containers"]
    assert container["name"] == "pytorch"
    return container


def test_pytorchjob_geometry_and_restarts(tiny_config: Path) -> None:
    files = render_k8s(_spec(tiny_config, "gaudi3", 4))
    (job,) = _kind(files, "PyTorchJob")
    spec = job["spec"]
    assert spec["pytorchReplicaSpecs"]["Master"]["replicas"] == 1
    assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    assert {r["restartPolicy"] for r in spec["pytorchReplicaSpecs"].values()} == {"ExitCode"}
    assert spec["nprocPerNode"] == "8"
    assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "rdzvHost": "tiny-k8s-master-0", "rdzvPort": 29400,
                                     "rdzvId": "tiny-k8s", "minReplicas": 4, "maxReplicas": 4, "maxRestarts": 3}  # fmt: skip
    args = _container(spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"])["args"]
    assert "--parallel.node_rank=$(PET_NODE_RANK)" in args
    assert "--parallel.rdzv_endpoint=tiny-k8s-master-0:29400" in args
    ports = _container(spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"])["ports"]
    assert {"name": "pytorchjob-port", "containerPort": 29400, "protocol": "TCP"} in ports  # → MASTER_PORT
    # One node: the operator refuses an elastic policy without workers, and there is nothing to rendezvous with.
    (single,) = _kind(render_k8s(_spec(tiny_config, "h100", 1)), "PyTorchJob")
    assert set(single["spec"]["pytorchReplicaSpecs"]) == {"Master"} and "elasticPolicy" not in single["spec"]


def test_exit_codes_restart_only_after_a_preemption_checkpoint(tiny_config: Path) -> None:
    assert set(RESTARTABLE_EXIT_CODES) <= set(RETRYABLE_EXIT_CODES)  # 143 / 138 are re-created ...
    for final in (2, BUDGET_EXIT_CODE, SPOT_PAUSE_EXIT_CODE, 1):  # ... bad input, budget, spot pause are not
        assert final not in RETRYABLE_EXIT_CODES
    (job,) = _kind(render_k8s(_spec(tiny_config)), "Job")
    fail_rule, ignore_rule = job["spec"]["podFailurePolicy"]["rules"]
    assert fail_rule["action"] == "FailJob"
    assert fail_rule["onExitCodes"] == {
        "containerName": "pytorch",
        "operator": "NotIn",
        "values": [130, 137, 138, 143],
    }
    assert ignore_rule == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # required by a podFailurePolicy


def test_indexed_job_rendezvous(tiny_config: Path) -> None:
    files = render_k8s(_spec(tiny_config, "h200", 3, extra={"namespace": "lab", "rdzv_port": 29500}))
    (service,) = _kind(files, "Service")
    (job,) = _kind(files, "Job")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 3
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    container = _container(pod)
    (rank_env,) = [e for e in container["env"] if e["name"] == "NODE_RANK"]
    assert rank_env["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert "--parallel.node_rank=$(NODE_RANK)" in container["args"]
    # Pod 0 of job J is J-0, reachable as J-0.<service>.<namespace>.svc.
    assert "--parallel.rdzv_endpoint=tiny-k8s-0.tiny-k8s.lab.svc:29500" in container["args"]
    assert {"name": "rdzv", "containerPort": 29500, "protocol": "TCP"} in container["ports"]


@pytest.mark.parametrize("kind", ["PyTorchJob", "Job"])
def test_the_pods_command_line_is_a_valid_train_command(
    kind: str, tiny_config: Path, tmp_path: Path, gaudi3_cli: Callable[..., tuple[int, str, str]]
) -> None:
    """The pod's args, with Kubernetes' $(VAR) expansion done by hand, through `gaudi3 train --print-config`."""
    files = render_k8s(_spec(tiny_config, "gaudi3", 2, "--monitor.metrics_port", "9300"))
    (config_map,) = [m for m in _kind(files, "ConfigMap") if "run.yaml" in m["data"]]  # not the dashboard
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(config_map["data"]["run.yaml"])
    pod = _pod_specs(files)[-1] if kind == "Job" else _pod_specs(files)[0]
    container = _container(pod)
    assert container["command"] == ["gaudi3"]
    args = [a.replace("$(PET_NODE_RANK)", "1").replace("$(NODE_RANK)", "1") for a in container["args"]]
    args = [str(run_yaml) if a == "/etc/gaudi3/run.yaml" else a for a in args]
    assert not [a for a in args if "$(" in a]
    code, out, err = gaudi3_cli(*args, "--print-config")
    assert code == 0, err
    resolved = yaml.safe_load(out)
    endpoint = "tiny-k8s-master-0:29400" if kind == "PyTorchJob" else "tiny-k8s-0.tiny-k8s.tiny-k8s.svc:29400"
    geometry = {
        "nproc_per_node": 8,
        "nnodes": 2,
        "node_rank": 1,
        "rdzv_endpoint": endpoint,
        "max_restarts": 3,
    }
    assert {key: resolved["parallel"][key] for key in geometry} == geometry
    assert resolved["monitor"]["metrics_port"] == 9300 and resolved["monitor"]["metrics_host"] == "0.0.0.0"
    assert resolved["out_dir"] == "/workspace/runs/tiny-k8s"
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/etc/gaudi3", "/workspace", "/tmp"}


def test_accelerator_resources_and_gaudi_settings(tiny_config: Path) -> None:
    for accelerator, resource in (("gaudi3", "habana.ai/gaudi"), ("gaudi2", "habana.ai/gaudi"),
                                  ("h100", "nvidia.com/gpu"), ("a100", "nvidia.com/gpu")):  # fmt: skip
        files = render_k8s(_spec(tiny_config, accelerator, 2, per_node=4))
        gaudi = accelerator.startswith("gaudi")
        for pod in _pod_specs(files):
            container = _container(pod)
            resources = container["resources"]
            assert resources["requests"] == resources["limits"]  # Guaranteed QoS
            assert resources["limits"][resource] == "4"
            assert resources["limits"]["cpu"] == "32" and resources["limits"]["memory"] == "256Gi"
            assert ("hugepages-2Mi" in resources["limits"]) is gaudi
            assert pod.get("hostIPC", False) is gaudi
            assert container["securityContext"]["capabilities"] == (
                {"drop": ["ALL"], "add": ["SYS_NICE"]} if gaudi else {"drop": ["ALL"]}
            )
            assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"]) is not gaudi
            assert pod["tolerations"][0]["key"] == resource
        assert ("not yet validated on Gaudi hardware" in files[FILES["pytorchjob"]]) is gaudi
        (namespace,) = _kind(files, "Namespace")
        enforce = namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
        # hostIPC + SYS_NICE are beyond "baseline"; two GPU nodes: the operator's init container on the Worker
        # meets "baseline" only (test_deploy_k8s_psa), and "restricted" stays the warn and audit level
        assert enforce == ("privileged" if gaudi else "baseline")
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/warn"] == "restricted"


def test_least_privilege(tiny_config: Path) -> None:
    files = render_k8s(_spec(tiny_config))
    (account,) = _kind(files, "ServiceAccount")
    (role,) = _kind(files, "Role")
    (binding,) = _kind(files, "RoleBinding")
    assert account["automountServiceAccountToken"] is False
    assert role["rules"] == []
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": "tiny-k8s"}]  # fmt: skip
    assert not _kind(files, "ClusterRole") and not _kind(files, "ClusterRoleBinding")
    for pod in _pod_specs(files):
        assert pod["serviceAccountName"] == account["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        security = _container(pod)["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
        assert "privileged" not in security


def test_metrics_port(tiny_config: Path) -> None:
    def exposed(files: dict[str, str]) -> tuple[list[int], dict[str, str] | None, list[str]]:
        (job,) = _kind(files, "PyTorchJob")
        template = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
        container = _container(template["spec"])
        ports = [p["containerPort"] for p in container["ports"] if p["name"].startswith("metrics-")]
        args = [a for a in container["args"] if a.startswith("--monitor.")]
        return ports, template["metadata"].get("annotations"), args

    # Off unless the run config asks: the image built from the same config has prometheus-client only then.
    files = render_k8s(_spec(tiny_config, "h100", 1, per_node=4))
    assert exposed(files) == ([], None, [])
    assert FILES["podmonitor"] not in files and not _kind(files, "PodMonitor")
    files = render_k8s(_spec(tiny_config, "h100", 1, "--monitor.metrics_port", "9200", per_node=2))
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "9200",
        "prometheus.io/path": "/metrics",
    }
    assert exposed(files) == (
        [9200, 9201],
        annotations,
        ["--monitor.metrics_port=9200", "--monitor.metrics_host=0.0.0.0"],
    )
    (monitor,) = _kind(files, "PodMonitor")
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics-0", "metrics-1"]
    assert (
        monitor["spec"]["selector"]["matchLabels"]
        == _kind(files, "Job")[0]["spec"]["template"]["metadata"]["labels"]
    )
    # 0 (a free port per rank) cannot be scraped by name: the pods use 9100 + local rank.
    ports, _, _ = exposed(
        render_k8s(_spec(tiny_config, "h100", 1, "--monitor.metrics_port", "0", per_node=2))
    )
    assert ports == [9100, 9101]
    with pytest.raises(
        UserInputError, match=r"^monitor\.metrics_port: 65530 \+ 7 local ranks is over 65535$"
    ):
        render_k8s(_spec(tiny_config, "h100", 1, "--monitor.metrics_port", "65530"))
    with pytest.raises(
        UserInputError, match=r"^k8s\.rdzv_port: 29400 is one of the metrics ports 29397-29404$"
    ):
        render_k8s(_spec(tiny_config, "h100", 1, "--monitor.metrics_port", "29397"))


def test_checkpoint_storage(tiny_config: Path) -> None:
    files = render_k8s(_spec(tiny_config, extra={"storage_class": "cephfs", "storage_size": "2Ti"}))
    (claim,) = _kind(files, "PersistentVolumeClaim")
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "2Ti"}},
                             "storageClassName": "cephfs"}  # fmt: skip
    for pod in _pod_specs(files):
        (workspace,) = [v for v in pod["volumes"] if v["name"] == "workspace"]
        assert workspace["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert "envFrom" not in _container(pod)  # no bucket, no credentials
    (default_class,) = _kind(render_k8s(_spec(tiny_config)), "PersistentVolumeClaim")
    assert "storageClassName" not in default_class["spec"]  # the cluster's default class

    with pytest.raises(UserInputError, match=r"^k8s\.storage: emptydir .* checkpoint\.remote_url"):
        render_k8s(_spec(tiny_config, extra={"storage": "emptydir"}))
    bucket = ("--checkpoint.remote_url", "s3://bucket/runs/tiny")
    files = render_k8s(_spec(tiny_config, "gaudi3", 2, *bucket, extra={"storage": "emptydir"}))
    assert FILES["storage"] not in files
    for pod in _pod_specs(files):
        (workspace,) = [v for v in pod["volumes"] if v["name"] == "workspace"]
        assert workspace == {"name": "workspace", "emptyDir": {}}
        assert _container(pod)["envFrom"] == [{"secretRef": {"name": "tiny-k8s-checkpoint-credentials"}}]
    assert (
        "kubectl -n tiny-k8s create secret generic tiny-k8s-checkpoint-credentials" in files[FILES["readme"]]
    )
    files = render_k8s(_spec(tiny_config, "gaudi3", 2, *bucket, extra={"credentials_secret": ""}))
    assert all("envFrom" not in _container(pod) for pod in _pod_specs(files))  # workload identity
    files = render_k8s(_spec(tiny_config, "gaudi3", 2, *bucket, extra={"credentials_secret": "minio-creds"}))
    assert all(
        _container(pod)["envFrom"][0]["secretRef"]["name"] == "minio-creds" for pod in _pod_specs(files)
    )


# Values that look like credentials: AWS key ids, long base64/hex blobs, a password in a URL, a private key.
_CREDENTIALS = re.compile(
    r"AKIA[0-9A-Z]{16}|[A-Za-z0-9/+]{40}|[0-9a-f]{64}|://[^/\s:@]+:[^/\s@]+@|-----BEGIN [A-Z ]*PRIVATE KEY-----"
)


def test_secrets_are_never_inlined(tiny_config: Path) -> None:
    bucket = ("--checkpoint.remote_url", "s3://bucket/runs/tiny")
    files = render_k8s(_spec(tiny_config, "gaudi3", 2, *bucket))
    assert not _kind(files, "Secret")
    for rel, text in files.items():
        assert not _CREDENTIALS.search(text), f"{rel}: {_CREDENTIALS.search(text)}"
    for rel, doc in _docs(files):  # no literal env value under a credential-like name
        for env in re.findall(
            r"name: (\S*(?:SECRET|PASSWORD|TOKEN|KEY|CREDENTIAL)\S*)\n\s+value:", yaml.safe_dump(doc)
        ):
            pytest.fail(f"{rel}: {env} has a literal value")
    for value in re.findall(r"--from-literal=\w+=(\S+)", files[FILES["readme"]]):
        assert re.fullmatch(r"<[^>]+>", value), value  # placeholders only
    # A URL with a password never gets this far: the config refuses it (tests/unit/test_url_credentials.py).
    tracking = ("--monitor.mlflow_tracking_uri", "https://alice:hunter2@mlflow.example")
    with pytest.raises(UserInputError, match=r"^monitor\.mlflow_tracking_uri: .* carries credentials"):
        _spec(tiny_config, "gaudi3", 2, *tracking)


def test_bad_input(tiny_config: Path) -> None:
    with pytest.raises(UserInputError, match=r"^--nodes: must be a positive integer, got 0$"):
        _spec(tiny_config, "gaudi3", 0)
    with pytest.raises(UserInputError, match=r"^--accelerator: must be one of .*got 'tpu'"):
        _spec(tiny_config, "tpu", 2)
    with pytest.raises(ConfigError, match=r"^k8s\.storage_klass: unknown field; allowed: .*storage_class"):
        render_k8s(_spec(tiny_config, extra={"storage_klass": "nfs"}))
    with pytest.raises(ConfigError, match=r"^k8s\.memory: must be a Kubernetes quantity"):
        render_k8s(_spec(tiny_config, extra={"memory": "lots"}))
    with pytest.raises(ConfigError, match=r"^k8s\.storage: got 'hostpath'; allowed: pvc, emptydir"):
        render_k8s(_spec(tiny_config, extra={"storage": "hostpath"}))
    with pytest.raises(
        UserInputError, match=r"^5 node\(s\) × 8 per node: train.global_batch_size: 96 is not divisible"
    ):
        render_k8s(_spec(tiny_config, "gaudi3", 5))  # 40 ranks
    with pytest.raises(UserInputError, match="must start with a letter"):
        render_k8s(_spec(tiny_config, "gaudi3", 2, "--name", "7b-run"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--nodes", "0"), r"--nodes: must be a positive integer, got 0"),
        (
            ("--accelerator", "tpu"),
            r"--accelerator: must be one of gaudi3, gaudi2, h100, h200, a100, got 'tpu'",
        ),
    ],
)
def test_bad_input_through_the_cli(
    args: tuple[str, str], message: str, tiny_config: Path, tmp_path: Path,
    gaudi3_cli: Callable[..., tuple[int, str, str]],
) -> None:  # fmt: skip
    base = {"--target": "k8s", "--accelerator": "gaudi3", "--nodes": "2", "--config": str(tiny_config),
            "--out": str(tmp_path / "out")}  # fmt: skip
    base[args[0]] = args[1]
    code, _, err = gaudi3_cli("deploy", "render", *[x for kv in base.items() for x in kv])
    assert code == 2
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_render_through_the_cli(
    tiny_config: Path, tmp_path: Path, gaudi3_cli: Callable[..., tuple[int, str, str]]
) -> None:
    out = tmp_path / "out"
    code, _, err = gaudi3_cli("deploy", "render", "--target", "k8s", "--accelerator", "h100", "--nodes", "2",
                              "--config", str(tiny_config), "--out", str(out), "--image", "registry.example/t:1")  # fmt: skip
    assert code == 0, err
    job = yaml.safe_load((out / FILES["pytorchjob"]).read_text())
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    assert (out / FILES["indexed"]).is_file() and (out / FILES["readme"]).is_file()


# ---- collect --------------------------------------------------------------------------------------------------


ENV = {"cpu": "test cpu", "packages": {"torch": "2.13.0"}, "git_commit": "abc"}


def _result(cell_id: str, pad: int = 0) -> dict[str, Any]:
    cell = cell_section(cell_id=cell_id, matrix="k8s", model="shakespeare-char", strategy="ddp", world_size=16,
                        nnodes=2, batch=BatchPlan.from_micro_batch(4, data_parallel_size=16, context_length=64),
                        precision="bf16-mixed", data="synthetic")  # fmt: skip
    return failed_result(cell, "failed", "x" * pad or "stopped", warmup_steps=1, environment=ENV)


def _pod_logs(directory: Path) -> dict[str, Path]:
    """Two pods' logs as `kubectl logs` shows them: rank 0's result (3 chunks) amid the other ranks' lines, with a
    timestamp and a rank prefix on every line; the worker pod printed no result."""
    buf = io.StringIO()
    print_result(_result("k8s.ddp.w16", pad=5000), buf)
    marker_lines = buf.getvalue().splitlines()
    assert len(marker_lines) > 4  # BEGIN, several chunks, END
    master: list[str] = []
    for i, line in enumerate(marker_lines):
        master += [f"2026-11-23T10:00:{i:02d}.000Z [rank{r}]:step {i} loss 4.{r}" for r in range(1, 8)]
        master.append(f"2026-11-23T10:00:{i:02d}.500Z [rank0]:{line}")
    worker = [f"2026-11-23T10:00:00Z [rank{r}]:step 1 loss 4.0" for r in range(8, 16)]
    paths = {"tiny-k8s-master-0": master, "tiny-k8s-worker-0": worker}
    for pod, lines in paths.items():
        (directory / f"{pod}.log").write_text("\n".join(lines) + "\n")
    return {pod: directory / f"{pod}.log" for pod in paths}


def test_collect_pod_logs_with_interleaved_prefixed_ranks(tmp_path: Path) -> None:
    logs = _pod_logs(tmp_path)
    (result,) = collect_pod_logs(sorted(logs.values()))
    assert result == _result("k8s.ddp.w16", pad=5000) | {"created": result["created"]}
    write_result(result, tmp_path / "out" / "result.json")
    assert load_result(tmp_path / "out" / "result.json")["cell"]["id"] == "k8s.ddp.w16"
    with pytest.raises(UserInputError, match=r"nope\.log: no such log file$"):
        collect_pod_logs([tmp_path / "nope.log"])
    with pytest.raises(UserInputError, match=r"^no benchmark result in the 1 log\(s\)"):
        collect_results([logs["tiny-k8s-worker-0"]], None, None)
    with pytest.raises(UserInputError, match="nothing to collect from"):
        collect_results(None, None, "default")


FAKE_KUBECTL = """\
#!{python}
# A stand-in for kubectl: no cluster here. Serves $FAKE_KUBECTL_DIR/<pod>.log for `logs pod/<pod>` and lists them
# for `get pods` when the label selector is $FAKE_KUBECTL_LABEL=<job>; records every call.
import os, sys
root = os.environ["FAKE_KUBECTL_DIR"]
with open(os.path.join(root, "calls"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
if os.environ.get("FAKE_KUBECTL_FAIL"):
    sys.stderr.write(os.environ["FAKE_KUBECTL_FAIL"] + "\\n")
    sys.exit(1)
args = sys.argv[1:]
if args[:2] == ["get", "pods"]:
    selector = args[args.index("-l") + 1]
    if selector.split("=")[0] == os.environ["FAKE_KUBECTL_LABEL"] and selector.split("=")[1] == "tiny-k8s":
        for name in sorted(os.listdir(root)):
            if name.endswith(".log"):
                print("pod/" + name[:-4])
elif args[0] == "logs":
    with open(os.path.join(root, args[1].removeprefix("pod/") + ".log")) as f:
        sys.stdout.write(f.read())
"""


@pytest.fixture
def fake_kubectl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir, served = tmp_path / "bin", tmp_path / "served"
    bin_dir.mkdir()
    served.mkdir()
    script = bin_dir / "kubectl"
    script.write_text(FAKE_KUBECTL.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("FAKE_KUBECTL_DIR", str(served))
    monkeypatch.setenv("FAKE_KUBECTL_LABEL", "training.kubeflow.org/job-name")
    _pod_logs(served)
    return served


def test_collect_from_a_pytorchjobs_pods(fake_kubectl: Path, tmp_path: Path) -> None:
    (result,) = collect_results(None, "tiny-k8s", "research")
    assert result["cell"]["id"] == "k8s.ddp.w16"
    calls = (fake_kubectl / "calls").read_text().splitlines()
    assert calls == [
        "get pods -n research -l training.kubeflow.org/job-name=tiny-k8s -o name",
        "logs pod/tiny-k8s-master-0 -n research -c pytorch",
        "logs pod/tiny-k8s-worker-0 -n research -c pytorch",
    ]
    saved = tmp_path / "saved"
    saved.mkdir()
    paths = kubectl_logs("tiny-k8s", None, saved)  # kubectl's current namespace
    assert [p.name for p in paths] == ["tiny-k8s-master-0.log", "tiny-k8s-worker-0.log"]
    assert paths[0].read_text() == (fake_kubectl / "tiny-k8s-master-0.log").read_text()


def test_collect_from_an_indexed_jobs_pods(fake_kubectl: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_KUBECTL_LABEL", "batch.kubernetes.io/job-name")
    (result,) = collect_results(None, "tiny-k8s", "default")
    assert result["cell"]["id"] == "k8s.ddp.w16"
    with pytest.raises(UserInputError, match=r"^no pods of job 'other' in namespace 'default' \(labels"):
        collect_results(None, "other", "default")


def test_collect_without_kubectl_or_a_cluster(
    fake_kubectl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_KUBECTL_FAIL", "error: You must be logged in to the server (Unauthorized)")
    with pytest.raises(
        UserInputError, match=r"^kubectl get pods: error: You must be logged in .*\(Unauthorized\)$"
    ):
        collect_results(None, "tiny-k8s", "default")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UserInputError, match=r"^kubectl is not on PATH: install it, or save the pods' logs"):
        collect_results(None, "tiny-k8s", "default")
