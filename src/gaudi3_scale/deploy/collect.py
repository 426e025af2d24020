"""Benchmark results of a job that ran on Kubernetes, from its pods' logs (`gaudi3 deploy collect`).

Rank 0 prints its result between the markers of `bench.result.print_result`; the pods' logs hold them with every
other rank's lines in between, and often a prefix per line (timestamps, pod names). `bench.collect.collect_logs`
already reads exactly that, so this module only finds the logs: files given by the user, or every pod of a job
fetched with `kubectl logs` (PyTorchJob pods carry `training.kubeflow.org/job-name`; the pods of an indexed Job
carry `batch.kubernetes.io/job-name`).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from gaudi3_scale.bench.collect import collect_logs
from gaudi3_scale.config.errors import UserInputError

__all__ = ["JOB_LABELS", "collect_pod_logs", "collect_results", "kubectl_logs"]

# The label a job's pods carry, per kind of job, tried in this order.
JOB_LABELS = ("training.kubeflow.org/job-name", "batch.kubernetes.io/job-name")
KUBECTL_TIMEOUT_S = 120


def collect_pod_logs(paths: list[Path]) -> list[dict[str, Any]]:
    """Results from saved logs (`kubectl logs POD > FILE`); a missing file is one line naming it."""
    return collect_logs(_existing(paths))


def _existing(paths: list[Path]) -> list[Path]:
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise UserInputError(f"{missing[0]}: no such log file")
    return paths


def _kubectl(kubectl: str, *args: str) -> str:
    try:
        done = subprocess.run(
            [kubectl, *args], capture_output=True, text=True, errors="replace", timeout=KUBECTL_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise UserInputError(
            f"kubectl {' '.join(args)}: no answer in {KUBECTL_TIMEOUT_S} s (is the cluster reachable?)"
        ) from None
    if done.returncode != 0:
        reason = next((line for line in done.stderr.splitlines() if line.strip()), f"exit {done.returncode}")
        raise UserInputError(f"kubectl {' '.join(args[:2])}: {reason.strip()}")
    return done.stdout


def kubectl_logs(job: str, namespace: str | None, out_dir: Path) -> list[Path]:
    """Save the log of every pod of `job` in `namespace` (None: kubectl's current one) as `out_dir/<pod>.log`;
    the paths, in pod-name order.

    Pods are found by the PyTorchJob label first, then by the Job label. Raises UserInputError (one line) when
    kubectl is not on PATH, fails, or finds no pod."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise UserInputError(
            "kubectl is not on PATH: install it, or save the pods' logs (kubectl logs POD > FILE) and pass the files"
        )
    scope = ["-n", namespace] if namespace else []
    pods: list[str] = []
    for label in JOB_LABELS:
        names = _kubectl(kubectl, "get", "pods", *scope, "-l", f"{label}={job}", "-o", "name")
        pods = sorted(line.strip().removeprefix("pod/") for line in names.splitlines() if line.strip())
        if pods:
            break
    if not pods:
        where = f"namespace {namespace!r}" if namespace else "kubectl's current namespace"
        raise UserInputError(f"no pods of job {job!r} in {where} (labels {', '.join(JOB_LABELS)})")
    paths = []
    for pod in pods:
        # -c pytorch: the training container (the name the training operator requires, used by both job kinds).
        text = _kubectl(kubectl, "logs", f"pod/{pod}", *scope, "-c", "pytorch")
        path = out_dir / f"{pod}.log"
        path.write_text(text)
        paths.append(path)
    return paths


def collect_results(
    log_paths: list[Path] | None, job: str | None, namespace: str | None
) -> list[dict[str, Any]]:
    """Results from `log_paths`, and from every pod of `job` when one is named; at least one result, or a
    UserInputError saying where nothing was found. A cell reported twice keeps its latest copy (`collect_logs`)."""
    if not log_paths and not job:
        raise UserInputError(
            "nothing to collect from: pass log files, or --job (and --namespace) to read pods"
        )
    with tempfile.TemporaryDirectory(prefix="gaudi3-pod-logs-") as tmp:
        paths = _existing(list(log_paths or []))
        if job:
            paths += kubectl_logs(job, namespace, Path(tmp))
        results = collect_logs(paths)
    if not results:
        where = f"{len(paths)} log(s)" + (f" (with the pods of job {job!r})" if job else "")
        raise UserInputError(
            f"no benchmark result in the {where}: rank 0 prints one only when benchmark.result is true and the "
            "run finished"
        )
    return results
