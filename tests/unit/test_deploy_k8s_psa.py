"""The PyTorchJob is admitted by the Pod Security level its own namespace enforces, with what the training operator
adds to its pods.

training-operator v1.9.0 (the PyTorchJob version the k8s target renders) runs `SetClusterSpec → setInitContainer`
for every Worker pod of a job with a Master (pkg/controller.v1/pytorch/initcontainer.go): an `init-pytorch` init
container, image alpine:3.10, that waits for the master's DNS name and has no securityContext. The checks below are
the Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards, pod-security-admission's
policy/check_*.go) that look at such a pod: each visits `spec.initContainers` as well as `spec.containers`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

Cli = Callable[..., tuple[int, str, str]]

TINY = """\
name: psa-run
model: {num_layers: 1}
train: {global_batch_size: 96, max_steps: 5}
"""
# Capabilities "baseline" allows to be added (pod-security-admission check_capabilities_baseline.go).
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}  # fmt: skip
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}  # fmt: skip


def operator_init_container(job_name: str) -> dict[str, Any]:
    """v1.9.0's init container, as its template (initcontainer.go) writes it for a Worker pod."""
    master = f"{job_name}-master-0"
    return {
        "name": "init-pytorch",
        "image": "alpine:3.10",
        "imagePullPolicy": "IfNotPresent",
        "resources": {"limits": {"cpu": "100m", "memory": "20Mi"}, "requests": {"cpu": "50m", "memory": "10Mi"}},
        "command": ["sh", "-c", f"err=1;for i in $(seq 100); do if nslookup {master}; then err=0 && break; fi;"
                    "echo waiting for master; sleep 2; done; exit $err"],
    }  # fmt: skip


def violations(pod: dict[str, Any], level: str) -> list[str]:
    """What `level` (privileged, baseline, restricted) forbids in the pod spec, one entry per container check."""
    if level == "privileged":
        return []
    found = [f"pod: {key}" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]
    found += [f"volume {v['name']}: hostPath" for v in pod.get("volumes", []) if "hostPath" in v]
    pod_sc = pod.get("securityContext") or {}
    containers = pod.get("initContainers", []) + pod["containers"]
    for c in containers:
        sc = c.get("securityContext") or {}
        caps = sc.get("capabilities") or {}
        if sc.get("privileged"):
            found.append(f"{c['name']}: privileged")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"{c['name']}: hostPort")
        if set(caps.get("add") or []) - BASELINE_CAPABILITIES:
            found.append(f"{c['name']}: capabilities.add beyond baseline")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp == "Unconfined":
            found.append(f"{c['name']}: seccomp Unconfined")
        if level != "restricted":
            continue
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{c['name']}: allowPrivilegeEscalation != false")
        if "ALL" not in (caps.get("drop") or []) or set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{c['name']}: capabilities not drop ALL")
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            found.append(f"{c['name']}: runAsNonRoot")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            found.append(f"{c['name']}: runAsUser 0")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{c['name']}: seccompProfile")
    if level == "restricted":
        for v in pod.get("volumes", []):
            kinds = set(v) - {"name"}
            if kinds - RESTRICTED_VOLUMES:
                found.append(f"volume {v['name']}: {sorted(kinds)}")
    return found


def _render(gaudi3_cli: Cli, tmp_path: Path, accelerator: str, nodes: int) -> Path:
    config = tmp_path / "run.yaml"
    config.write_text(TINY)
    out = tmp_path / "out"
    result = gaudi3_cli("deploy", "render", "--target", "k8s", "--accelerator", accelerator, "--nodes", str(nodes),
                        "--per-node", "8", "--config", str(config), "--out", str(out))  # fmt: skip
    assert result[0] == 0, result
    return out / "k8s"


@pytest.mark.parametrize("accelerator", ["h100", "a100", "gaudi3"])
@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_every_pod_the_operator_creates_is_admitted_by_the_namespace(
    gaudi3_cli: Cli, tmp_path: Path, accelerator: str, nodes: int
) -> None:
    k8s = _render(gaudi3_cli, tmp_path, accelerator, nodes)
    labels = yaml.safe_load((k8s / "base" / "00-namespace.yaml").read_text())["metadata"]["labels"]
    enforce = labels["pod-security.kubernetes.io/enforce"]
    job = yaml.safe_load((k8s / "pytorchjob.yaml").read_text())
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert ("Worker" in replicas) is (nodes > 1)
    for kind, replica in replicas.items():
        pod = dict(replica["template"]["spec"])
        if kind == "Worker" and "Master" in replicas:  # what the operator does to it (v1.9.0)
            pod["initContainers"] = [
                *pod.get("initContainers", []),
                operator_init_container(job["metadata"]["name"]),
            ]
        assert violations(pod, enforce) == [], (kind, enforce)
        # the job's own pod meets "restricted" on a GPU: the warn and audit levels stay there
        if accelerator != "gaudi3":
            assert violations(replica["template"]["spec"], "restricted") == []
    assert (
        labels["pod-security.kubernetes.io/warn"]
        == labels["pod-security.kubernetes.io/audit"]
        == "restricted"
    )
    expected = "privileged" if accelerator == "gaudi3" else ("baseline" if nodes > 1 else "restricted")
    assert enforce == expected
    readme = (k8s / "README.md").read_text()
    assert ("init-pytorch" in readme) is (expected == "baseline")
    if expected == "baseline":
        # the indexed Job (no operator) meets "restricted": the README says how to enforce it there
        for document in yaml.safe_load_all((k8s / "indexed-job.yaml").read_text()):
            if document["kind"] == "Job":
                assert violations(document["spec"]["template"]["spec"], "restricted") == []
        relabel = "kubectl label namespace psa-run pod-security.kubernetes.io/enforce=restricted --overwrite"
        assert relabel in " ".join(readme.split())


def test_the_injected_init_container_is_what_restricted_rejects() -> None:
    """The check above can fail: a Worker pod with v1.9's init container breaks "restricted"."""
    pod = {"containers": [], "initContainers": [operator_init_container("j")]}
    assert violations(pod, "restricted") and not violations(pod, "baseline")


def test_the_readme_lists_the_options_and_gaudi_notes_sys_nice(gaudi3_cli: Cli, tmp_path: Path) -> None:
    # docs/how-to/deploy.md: the --set options are "listed in the rendered k8s/README.md"
    from dataclasses import fields

    from gaudi3_scale.deploy.k8s_options import K8sOptions

    readme = (_render(gaudi3_cli, tmp_path, "gaudi3", 2) / "README.md").read_text()
    for f in fields(K8sOptions):
        assert f"- `{f.name}` = `" in readme, f.name
    assert "- `storage_size` = `500Gi`" in readme and "- `namespace` = `null`" in readme
    assert "SYS_NICE" in readme and "non-root" in readme
