"""`--target k8s`: the monitoring stack of a run, under `k8s/monitoring/` (`--set monitoring=false` leaves it out).

    k8s/monitoring/helm/kube-prometheus-stack-values.yaml  Helm values for the stack; the install commands on top
    k8s/monitoring/podmonitor.yaml          PodMonitor: every rank's /metrics (run namespace)
    k8s/monitoring/alertmanagerconfig.yaml  AlertmanagerConfig: the alerts to a webhook whose URL is a Secret (run ns)
    k8s/monitoring/prometheusrule.yaml      PrometheusRule: monitor/assets/alerts.yml (monitoring namespace)
    k8s/monitoring/grafana-dashboard.yaml   ConfigMap: monitor/assets/grafana/gaudi3-training.json (monitoring ns)

The values sit one folder down so that `kubectl apply -f k8s/monitoring/` (not recursive) applies the manifests only.

Where each object lives. Rules are evaluated over every namespace's series, so one PrometheusRule serves every run:
it and the dashboard go to the monitoring namespace under fixed names (a second run re-applies the same objects).
The operator scopes an AlertmanagerConfig to alerts whose `namespace` label is its own namespace (matcher strategy
OnNamespace, pinned in the values), so the routing lives in the run's namespace, where the PodMonitor's series (and
so the alerts) carry that label. Selection: kube-prometheus-stack's Prometheus picks PodMonitors and PrometheusRules
labelled `release: <release name>` (its `*SelectorNilUsesHelmValues` defaults), which ours carry; its Alertmanager
picks every AlertmanagerConfig; Grafana's sidecar every ConfigMap labelled `grafana_dashboard: "1"`.

Secrets are referenced, never rendered: Grafana's admin login (`k8s.grafana_admin_secret`, which you generate) and the
alert webhook URL (`k8s.alert_webhook_secret`). The CRDs are validated offline against our schemas in `schemas/`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gaudi3_scale.deploy.k8s_options import JobPlan
from gaudi3_scale.deploy.monitoring import (
    ALERT_ROUTE,
    DASHBOARD_FILE,
    KPS_CHART_VERSION,
    KPS_RELEASE,
    METRICS_JOB,
    alert_groups,
    dashboard_text,
)
from gaudi3_scale.deploy.quoting import comment, sh_quote, yaml_text

__all__ = ["MONITORING_FILES", "SCHEMAS", "monitoring_manifests", "monitoring_readme", "stack_values_text"]

MONITORING_FILES = {
    "values": "k8s/monitoring/helm/kube-prometheus-stack-values.yaml",
    "podmonitor": "k8s/monitoring/podmonitor.yaml",
    "alertmanagerconfig": "k8s/monitoring/alertmanagerconfig.yaml",
    "prometheusrule": "k8s/monitoring/prometheusrule.yaml",
    "dashboard": "k8s/monitoring/grafana-dashboard.yaml",
}
_SCHEMA_DIR = Path(__file__).parent / "schemas"
SCHEMAS = {  # our JSON schemas of the Prometheus Operator CRDs we render (the fields we use, plus required ones)
    "PodMonitor": _SCHEMA_DIR / "podmonitor-v1.schema.json",
    "PrometheusRule": _SCHEMA_DIR / "prometheusrule-v1.schema.json",
    "AlertmanagerConfig": _SCHEMA_DIR / "alertmanagerconfig-v1alpha1.schema.json",
}
RULES_NAME = "gaudi3-training"  # the PrometheusRule, in the monitoring namespace
DASHBOARD_NAME = "gaudi3-training-dashboard"  # its ConfigMap
ROUTING_NAME = "gaudi3-alerts"  # the AlertmanagerConfig, one per namespace (runs sharing one share it)
RECEIVER = "gaudi3-webhook"
WEBHOOK_KEY = "url"  # the key of k8s.alert_webhook_secret that holds the URL
# kube-prometheus-stack's Grafana sidecar loads ConfigMaps labelled so (its defaults, pinned in the values).
SIDECAR_LABEL = ("grafana_dashboard", "1")
_STACK_LABELS = {"app.kubernetes.io/name": "gaudi3-scale", "app.kubernetes.io/component": "monitoring"}


def _meta(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels}


def pod_monitor(plan: JobPlan) -> dict[str, Any]:
    """One endpoint per local rank (port metrics-<i>), all in the scrape job alerts.yml watches (`job` relabelled
    after the operator's own `<namespace>/<name>` job label)."""
    relabel_job = [{"targetLabel": "job", "replacement": METRICS_JOB}]
    endpoints = [
        {"port": f"metrics-{i}", "path": "/metrics", "interval": "15s", "relabelings": relabel_job}
        for i in range(plan.per_node)
    ]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _meta(plan.name, plan.namespace, {**plan.labels, "release": KPS_RELEASE}),
        "spec": {"selector": {"matchLabels": dict(plan.labels)}, "podMetricsEndpoints": endpoints},
    }


def prometheus_rule(plan: JobPlan) -> dict[str, Any]:
    namespace = plan.opts.monitoring_namespace
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": _meta(RULES_NAME, namespace, {**_STACK_LABELS, "release": KPS_RELEASE}),
        "spec": {"groups": alert_groups()},
    }


def dashboard_config_map(plan: JobPlan) -> dict[str, Any]:
    key, value = SIDECAR_LABEL
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(DASHBOARD_NAME, plan.opts.monitoring_namespace, {**_STACK_LABELS, key: value}),
        "data": {DASHBOARD_FILE: dashboard_text()},
    }


def _alert_names() -> list[str]:
    return [rule["alert"] for group in alert_groups() for rule in group["rules"] if "alert" in rule]


def alertmanager_config(plan: JobPlan) -> dict[str, Any]:
    """Our alerts (by name, from alerts.yml) to one webhook receiver, grouped per run."""
    camel = {"group_by": "groupBy", "group_wait": "groupWait", "group_interval": "groupInterval",
             "repeat_interval": "repeatInterval"}  # fmt: skip
    route: dict[str, Any] = {"receiver": RECEIVER, **{camel[k]: v for k, v in ALERT_ROUTE.items()}}
    route["matchers"] = [{"name": "alertname", "matchType": "=~", "value": "|".join(_alert_names())}]
    webhook = {
        "urlSecret": {"name": plan.opts.alert_webhook_secret, "key": WEBHOOK_KEY},
        "sendResolved": True,
    }
    return {
        "apiVersion": "monitoring.coreos.com/v1alpha1",
        "kind": "AlertmanagerConfig",
        "metadata": _meta(ROUTING_NAME, plan.namespace, dict(_STACK_LABELS)),
        "spec": {"route": route, "receivers": [{"name": RECEIVER, "webhookConfigs": [webhook]}]},
    }


_NOTES = {
    "podmonitor": [
        "Rank r of a pod serves metrics on port monitor.metrics_port + its local rank; one endpoint per local rank,",
        f"all in scrape job {METRICS_JOB!r} (the job the Gaudi3MetricsEndpointDown alert watches).",
    ],
    "alertmanagerconfig": [
        "Routes this namespace's gaudi3 alerts to a webhook. FILL IN: its URL is read from the Secret named below",
        "(key `url`), which you create; see k8s/README.md.",
    ],
    "prometheusrule": [
        "The alert rules of gaudi3_scale/monitor/assets/alerts.yml (promtool-tested there), for every run.",
    ],
    "dashboard": [
        "The Grafana dashboard gaudi3_scale/monitor/assets/grafana/gaudi3-training.json; Grafana's sidecar loads",
        'every ConfigMap labelled grafana_dashboard: "1".',
    ],
}


def monitoring_manifests(plan: JobPlan) -> dict[str, tuple[list[dict[str, Any]], list[str]]]:
    """{file: (documents, notes)} of the stack's manifests (all need the Prometheus Operator's CRDs but the
    dashboard)."""
    docs = {
        "podmonitor": pod_monitor(plan),
        "alertmanagerconfig": alertmanager_config(plan),
        "prometheusrule": prometheus_rule(plan),
        "dashboard": dashboard_config_map(plan),
    }
    operator = [
        "Needs the Prometheus Operator's CRDs: install kube-prometheus-stack first (helm/, k8s/README.md)."
    ]
    return {
        MONITORING_FILES[key]: ([doc], [*(operator if key != "dashboard" else []), *_NOTES[key]])
        for key, doc in docs.items()
    }


def stack_values(plan: JobPlan) -> dict[str, Any]:
    key, value = SIDECAR_LABEL
    return {
        "grafana": {
            # No password here: the chart reads the admin login from this Secret (its keys below).
            "admin": {
                "existingSecret": plan.opts.grafana_admin_secret,
                "userKey": "admin-user",
                "passwordKey": "admin-password",
            },
            "sidecar": {
                "dashboards": {"enabled": True, "label": key, "labelValue": value, "searchNamespace": "ALL"}
            },
        },
        # Each AlertmanagerConfig routes only alerts from its own namespace: the run's alerts stay the run's.
        "alertmanager": {"alertmanagerSpec": {"alertmanagerConfigMatcherStrategy": {"type": "OnNamespace"}}},
    }


def install_commands(plan: JobPlan) -> list[str]:
    namespace = sh_quote(plan.opts.monitoring_namespace)
    return [
        f"kubectl create namespace {namespace}",
        f"kubectl -n {namespace} create secret generic {sh_quote(plan.opts.grafana_admin_secret)} \\",
        '  --from-literal=admin-user=admin --from-literal=admin-password="$(openssl rand -base64 24)"',
        "helm repo add prometheus-community https://prometheus-community.github.io/helm-charts",
        f"helm upgrade --install {KPS_RELEASE} prometheus-community/kube-prometheus-stack \\",
        f"  --version {KPS_CHART_VERSION} --namespace {namespace} -f {MONITORING_FILES['values']}",
    ]


def stack_values_text(plan: JobPlan, notes: list[str]) -> str:
    head = [
        *notes,
        "Helm values for kube-prometheus-stack (Prometheus Operator, Prometheus, Alertmanager, Grafana). Install:",
        "",
        *(f"  {line}" for line in install_commands(plan)),
        "",
        f"Keep the release name {KPS_RELEASE}: its Prometheus selects PodMonitors and PrometheusRules labelled",
        "release=<release name>, as ours are. Then apply k8s/monitoring/ (k8s/README.md).",
    ]
    return "".join(f"# {comment(line)}".rstrip() + "\n" for line in head) + yaml_text(stack_values(plan))


def monitoring_readme(plan: JobPlan) -> list[str]:
    namespace = sh_quote(plan.namespace)
    return [
        "",
        "## Monitoring",
        "",
        "`k8s/monitoring/` holds the monitoring stack (leave it out with `--set monitoring=false`): Helm values for",
        "kube-prometheus-stack, a PodMonitor for every rank, the alert rules (PrometheusRule), the Grafana dashboard",
        "(ConfigMap) and an AlertmanagerConfig that sends the alerts to a webhook. Install the stack once per cluster,",
        "then apply the run's objects after `k8s/base/` (the run's namespace must exist):",
        "",
        "```",
        *install_commands(plan),
        f"kubectl -n {namespace} create secret generic {sh_quote(plan.opts.alert_webhook_secret)} \\",
        "  --from-literal=url=<your-webhook-url>   # FILL IN: where Alertmanager posts the alerts",
        "kubectl apply -f k8s/monitoring/",
        "```",
        "",
        f"- Grafana's admin login is the Secret `{plan.opts.grafana_admin_secret}` in namespace",
        f"  `{plan.opts.monitoring_namespace}`, with a generated password; nothing in these files holds a password.",
        f"- The alert webhook's URL is the key `{WEBHOOK_KEY}` of the Secret `{plan.opts.alert_webhook_secret}` in",
        f"  `{plan.namespace}`; until it exists the operator rejects the AlertmanagerConfig (a warning event on it",
        "  says so) and the alerts show in Prometheus and Alertmanager only.",
        f"- The rules and the dashboard live in `{plan.opts.monitoring_namespace}` and serve every run.",
    ]
