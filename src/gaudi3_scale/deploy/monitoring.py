"""What the k8s and onprem targets' monitoring stacks share: the rules, the dashboard, the routing, the versions.

The alert rules and the Grafana dashboard have one home, `gaudi3_scale/monitor/assets/` (alerts.yml is
promtool-tested there, against its own rule tests). The renderers read them at render time and wrap them for their
target: a PrometheusRule and a dashboard ConfigMap on Kubernetes (`k8s_monitoring.py`), files that Ansible
provisions on-prem (`onprem_monitoring.py`).

Both stacks render only what they can feed: the training ranks serve metrics only when the run config sets
`monitor.metrics_port` (the image has prometheus-client only then), so the stack follows that setting unless
`--set monitoring=true|false` says otherwise.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

from gaudi3_scale.config.errors import UserInputError

__all__ = [
    "ALERTMANAGER_IMAGE",
    "ALERT_ROUTE",
    "DASHBOARD_FILE",
    "DEFAULT_METRICS_PORT",
    "GRAFANA_IMAGE",
    "KPS_CHART_VERSION",
    "KPS_RELEASE",
    "METRICS_JOB",
    "PROMETHEUS_IMAGE",
    "alert_groups",
    "alerts_text",
    "asset_text",
    "dashboard_text",
    "metrics_port",
    "monitoring_on",
]

# The same folder as monitor.prometheus.ASSETS_DIR, found without importing that module (it imports torch).
_ASSETS = resources.files("gaudi3_scale.monitor").joinpath("assets")
DASHBOARD_FILE = "gaudi3-training.json"  # under assets/grafana/
DEFAULT_METRICS_PORT = 9100  # for a run config's monitor.metrics_port 0; rank r serves on it + its local rank
# The scrape job of the training ranks: alerts.yml's Gaudi3MetricsEndpointDown watches up{job="gaudi3"}.
METRICS_JOB = "gaudi3"
# Alertmanager grouping, as alerts.yml asks: every rank reports the run-wide values, so one notification per run.
ALERT_ROUTE = {
    "group_by": ["alertname", "run"],
    "group_wait": "30s",
    "group_interval": "5m",
    "repeat_interval": "4h",
}

# Versions, from kube-prometheus-stack 88.5.3 (prometheus-community/helm-charts charts/kube-prometheus-stack:
# values.yaml and Chart.yaml, commit cf408a290 of 2026-08-22) and the Grafana chart it depends on (12.11.1,
# grafana-community/helm-charts, appVersion 13.2.0): the k8s target installs that chart, the onprem target runs the
# same images.
KPS_CHART_VERSION = "88.5.3"
KPS_RELEASE = (
    "kube-prometheus-stack"  # the Helm release name; its Prometheus selects objects labelled release=<it>
)
PROMETHEUS_IMAGE = "quay.io/prometheus/prometheus:v3.14.0-distroless"
ALERTMANAGER_IMAGE = "quay.io/prometheus/alertmanager:v0.34.0"
GRAFANA_IMAGE = "docker.io/grafana/grafana:13.2.0"


def asset_text(*parts: str) -> str:
    return _ASSETS.joinpath(*parts).read_text(encoding="utf-8")


def alerts_text() -> str:
    """alerts.yml as shipped (Prometheus rule-file format)."""
    return asset_text("alerts.yml")


def alert_groups() -> list[dict[str, Any]]:
    """The rule groups of alerts.yml, as data (the `groups` of a rule file and of a PrometheusRule's spec)."""
    groups = yaml.safe_load(alerts_text())["groups"]
    assert isinstance(groups, list) and groups, "monitor/assets/alerts.yml has no rule groups"
    return groups


def dashboard_text() -> str:
    """The Grafana dashboard JSON as shipped."""
    return asset_text("grafana", DASHBOARD_FILE)


def metrics_port(configured: int | None, per_node: int, *, rdzv_port: int, rdzv_field: str) -> int | None:
    """The first of a node's metrics ports: the run config's `monitor.metrics_port`, or None when it serves none. A
    config's 0 (a free port per rank) becomes the default port: a scrape config must be able to name the ports."""
    if configured is None:
        return None
    port = configured or DEFAULT_METRICS_PORT
    last = port + per_node - 1
    if last > 65535:
        raise UserInputError(f"monitor.metrics_port: {port} + {per_node - 1} local ranks is over 65535")
    if port <= rdzv_port <= last:
        raise UserInputError(f"{rdzv_field}: {rdzv_port} is one of the metrics ports {port}-{last}")
    return port


def monitoring_on(requested: bool | None, port: int | None, field: str) -> bool:
    """Whether to render the stack: `requested` (the `monitoring` option), or by default when there are metrics."""
    if requested is None:
        return port is not None
    if requested and port is None:
        raise UserInputError(
            f"{field}: true needs monitor.metrics_port in the run config (without it the ranks serve no metrics); "
            f"set it there (e.g. metrics_port: {DEFAULT_METRICS_PORT} under monitor:), or leave {field} unset"
        )
    return requested
