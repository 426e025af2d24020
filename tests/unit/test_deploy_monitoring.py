"""The monitoring stack `gaudi3 deploy render` writes for the k8s and onprem targets, validated offline.

k8s: the custom resources against our schemas (`deploy/schemas/`), the dashboard ConfigMap against the Kubernetes
OpenAPI schemas (kubernetes-validate), the PrometheusRule's rules through `promtool check rules` and the shipped rule
tests (`promtool test rules`). onprem: the Prometheus config through `promtool check config`, both playbooks through
`ansible-playbook --syntax-check` and their module arguments against `ansible-doc`, and the Alertmanager template and
the password lookup run by Ansible itself on this machine (connection local). promtool comes from Debian's
`prometheus` package (a test without it skips, or fails under GAUDI3_REQUIRE_SYSTEM_TOOLS=1); Ansible from the
`test` extra (ansible-core).

Golden files: the k8s stack is in `tests/golden/deploy/k8s/gaudi3-x2/` (test_deploy_k8s.py), the onprem one in
`tests/golden/deploy/onprem-monitoring/` (less the verbatim copies of the shipped assets, compared with them instead):

    GAUDI3_UPDATE_GOLDEN=1 .venv/bin/pytest tests/unit/test_deploy_monitoring.py
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jinja2
import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import missing_system_tool
from deploy_readers import GoYamlLikeLoader
from gaudi3_scale.config.core import to_dict
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.deploy.k8s_monitoring import MONITORING_FILES, SCHEMAS
from gaudi3_scale.deploy.kubernetes import render_k8s
from gaudi3_scale.deploy.monitoring import (
    ALERTMANAGER_IMAGE,
    GRAFANA_IMAGE,
    METRICS_JOB,
    PROMETHEUS_IMAGE,
    alerts_text,
    asset_text,
    dashboard_text,
)
from gaudi3_scale.deploy.onprem import render_onprem
from gaudi3_scale.deploy.spec import DeploySpec
from gaudi3_scale.train.config import resolve_config

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "deploy" / "onprem-monitoring"
K8S_VERSION = "1.30"
TINY = """\
name: tiny-mon
model:
  num_layers: 1
train:
  global_batch_size: 96
  max_steps: 20
"""
HOSTS = ("gpu-a.lab", "10.1.2.3", "fd00::3")
ASSET_COPIES = {  # rendered files that are the shipped assets verbatim
    "ansible/files/monitoring/alerts.yml": ("alerts.yml",),
    "ansible/files/monitoring/grafana/gaudi3-training.json": ("grafana", "gaudi3-training.json"),
}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("monitoring") / "run.yaml"
    path.write_text(TINY)
    return path


def _spec(config: Path, target: str = "k8s", *overrides: str, **kw: Any) -> DeploySpec:
    # onprem nodes keep --out on their own disks: a DDP run needs a remote mirror to resume from (`node_command`)
    mirror = ["--checkpoint.remote_url", "s3://tiny-bucket/tiny-mon"] if target == "onprem" else []
    cfg = resolve_config(str(config), [*overrides, *mirror])
    fields: dict[str, Any] = dict(target=target, accelerator="gaudi3", nodes=2, per_node=8, config_path=config,
                                  run_config=to_dict(cfg), name=cfg.name, image="registry.example/t:1")  # fmt: skip
    if target == "onprem":
        fields.update(nodes=len(HOSTS), hosts=HOSTS, per_node=4)
    return DeploySpec(**(fields | kw))


METRICS = ("--monitor.metrics_port", "9100")


def _objects(files: dict[str, str]) -> Iterator[dict[str, Any]]:
    for rel, text in files.items():
        if rel.startswith("k8s/monitoring/") and rel != MONITORING_FILES["values"]:
            yield from yaml.safe_load_all(text)


def _kind(files: dict[str, str], kind: str) -> dict[str, Any]:
    (found,) = [doc for doc in _objects(files) if doc["kind"] == kind]
    return found


@pytest.fixture(scope="module")
def schemas() -> dict[str, dict[str, Any]]:
    loaded = {kind: json.loads(path.read_text()) for kind, path in SCHEMAS.items()}
    for schema in loaded.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    return loaded


def _promtool(*args: str, cwd: Path) -> str:
    tool = shutil.which("promtool")
    if tool is None:
        missing_system_tool("`promtool` is not on PATH (Debian/Ubuntu: apt-get install prometheus)")
    done = subprocess.run([str(tool), *args], capture_output=True, text=True, cwd=cwd, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


# ---- k8s ------------------------------------------------------------------------------------------------------


def test_k8s_stack_validates_and_fits_together(tiny_config: Path, schemas: dict[str, dict[str, Any]]) -> None:
    files = render_k8s(_spec(tiny_config, "k8s", *METRICS, extra={"namespace": "team-a"}))
    assert set(MONITORING_FILES.values()) <= set(files)
    for rel in MONITORING_FILES.values():  # kubectl and Helm (Go YAML) read what PyYAML reads
        text = files[rel]
        assert list(yaml.load_all(text, Loader=GoYamlLikeLoader)) == list(yaml.safe_load_all(text)), rel
    kinds = set()
    for doc in _objects(files):
        kinds.add(doc["kind"])
        if doc["kind"] in schemas:
            jsonschema.validate(doc, schemas[doc["kind"]])
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert kinds == {"PodMonitor", "PrometheusRule", "AlertmanagerConfig", "ConfigMap"}

    # The PodMonitor scrapes the pods' named metrics ports, in the job the alert rules watch.
    (job,) = [d for d in yaml.safe_load_all(files["k8s/indexed-job.yaml"]) if d["kind"] == "Job"]
    pod = job["spec"]["template"]
    monitor = _kind(files, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == [f"metrics-{i}" for i in range(8)]
    assert {e["port"] for e in endpoints} <= ports
    assert all(e["relabelings"] == [{"targetLabel": "job", "replacement": METRICS_JOB}] for e in endpoints)
    assert f'up{{job="{METRICS_JOB}"}}' in alerts_text()
    # kube-prometheus-stack's Prometheus selects by its release label; the rules are alerts.yml's, not a copy.
    rule = _kind(files, "PrometheusRule")
    assert (
        monitor["metadata"]["labels"]["release"]
        == rule["metadata"]["labels"]["release"]
        == "kube-prometheus-stack"
    )
    assert rule["spec"]["groups"] == yaml.safe_load(alerts_text())["groups"]
    dashboard = _kind(files, "ConfigMap")
    assert dashboard["data"] == {"gaudi3-training.json": dashboard_text()}
    assert (rule["metadata"]["namespace"], dashboard["metadata"]["namespace"]) == ("monitoring", "monitoring")

    # Alertmanager: the run's namespace, a receiver that exists, its URL from a Secret; every alert is routed.
    routing = _kind(files, "AlertmanagerConfig")
    assert routing["metadata"]["namespace"] == monitor["metadata"]["namespace"] == "team-a"
    route, (receiver,) = routing["spec"]["route"], routing["spec"]["receivers"]
    assert route["receiver"] == receiver["name"] and route["groupBy"] == ["alertname", "run"]
    assert receiver["webhookConfigs"] == [{"urlSecret": {"name": "gaudi3-alert-webhook", "key": "url"},
                                          "sendResolved": True}]  # fmt: skip
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    (matcher,) = route["matchers"]
    assert matcher["matchType"] == "=~" and set(matcher["value"].split("|")) == alerts

    # The Helm values: Grafana's login from a Secret, its sidecar loading our ConfigMap's label.
    values = yaml.safe_load(files[MONITORING_FILES["values"]])
    grafana = values["grafana"]
    assert grafana["admin"] == {"existingSecret": "grafana-admin", "userKey": "admin-user",
                                "passwordKey": "admin-password"}  # fmt: skip
    sidecar = grafana["sidecar"]["dashboards"]
    assert dashboard["metadata"]["labels"][sidecar["label"]] == sidecar["labelValue"] == "1"
    assert "adminPassword" not in json.dumps(values)
    assert values["alertmanager"]["alertmanagerSpec"]["alertmanagerConfigMatcherStrategy"] == {
        "type": "OnNamespace"
    }
    header = files[MONITORING_FILES["values"]]
    assert "helm upgrade --install kube-prometheus-stack prometheus-community/kube-prometheus-stack" in header
    assert f"-f {MONITORING_FILES['values']}" in header and "--version 88.5.3" in header


def test_k8s_schemas_refuse_broken_resources(tiny_config: Path, schemas: dict[str, dict[str, Any]]) -> None:
    files = render_k8s(_spec(tiny_config, "k8s", *METRICS))
    breaks: dict[str, dict[str, Callable[[dict[str, Any]], Any]]] = {
        "PodMonitor": {
            "typo in an endpoint": lambda d: d["spec"]["podMetricsEndpoints"][0].update(intervall="15s"),
            "no selector": lambda d: d["spec"].pop("selector"),
            "bad interval": lambda d: d["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds"),
            "replace without targetLabel": lambda d: d["spec"]["podMetricsEndpoints"][0]["relabelings"][
                0
            ].pop("targetLabel"),
        },
        "PrometheusRule": {
            "alert and record": lambda d: d["spec"]["groups"][0]["rules"][0].update(record="x:y"),
            "no expr": lambda d: d["spec"]["groups"][0]["rules"][0].pop("expr"),
            "unknown rule field": lambda d: d["spec"]["groups"][0]["rules"][0].update(severity="critical"),
            "bad for": lambda d: d["spec"]["groups"][0]["rules"][0].update({"for": "1 minute"}),
            "wrong apiVersion": lambda d: d.update(apiVersion="monitoring.coreos.com/v2"),
        },
        "AlertmanagerConfig": {
            "webhook without a URL": lambda d: d["spec"]["receivers"][0]["webhookConfigs"][0].pop(
                "urlSecret"
            ),
            "route without receiver": lambda d: d["spec"]["route"].pop("receiver"),
            "unknown match type": lambda d: d["spec"]["route"]["matchers"][0].update(matchType="~"),
            "secret without key": lambda d: d["spec"]["receivers"][0]["webhookConfigs"][0]["urlSecret"].pop(
                "key"
            ),
        },
    }
    for kind, changes in breaks.items():
        good = _kind(files, kind)
        jsonschema.validate(good, schemas[kind])
        for what, change in changes.items():
            broken = copy.deepcopy(good)
            change(broken)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(broken, schemas[kind])
                pytest.fail(f"{kind}: {what} passed the schema")


def test_k8s_rules_pass_promtool_and_the_shipped_rule_tests(tiny_config: Path, tmp_path: Path) -> None:
    rule = _kind(render_k8s(_spec(tiny_config, "k8s", *METRICS)), "PrometheusRule")
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    (tmp_path / "alerts_test.yml").write_text(asset_text("alerts_test.yml"))  # rule_files: [alerts.yml]
    assert "SUCCESS: 11 rules found" in _promtool("check", "rules", "alerts.yml", cwd=tmp_path)
    assert "SUCCESS" in _promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)


def test_monitoring_option(tiny_config: Path) -> None:
    values = MONITORING_FILES["values"]
    assert values in render_k8s(_spec(tiny_config, "k8s", *METRICS))  # on with metrics ...
    assert values not in render_k8s(_spec(tiny_config, "k8s"))  # ... off without
    files = render_k8s(_spec(tiny_config, "k8s", *METRICS, extra={"monitoring": False}))
    assert not [rel for rel in files if rel.startswith("k8s/monitoring/")]
    assert (
        "## Monitoring" not in files["k8s/README.md"]
        and "kubectl apply -f k8s/monitoring/" not in files["k8s/README.md"]
    )
    files = render_k8s(_spec(tiny_config, "k8s", *METRICS, extra={"monitoring_namespace": "obs",
                                                                   "alert_webhook_secret": "pager"}))  # fmt: skip
    assert _kind(files, "PrometheusRule")["metadata"]["namespace"] == "obs"
    assert "kubectl -n tiny-mon create secret generic pager" in files["k8s/README.md"]
    with pytest.raises(
        UserInputError, match=r"^k8s\.monitoring: true needs monitor\.metrics_port in the run config"
    ):
        render_k8s(_spec(tiny_config, "k8s", extra={"monitoring": True}))
    with pytest.raises(ConfigError, match=r"^k8s\.monitoring: .*true or false"):
        render_k8s(_spec(tiny_config, "k8s", *METRICS, extra={"monitoring": "maybe"}))
    with pytest.raises(ConfigError, match=r"^k8s\.monitoring_namespace: "):
        render_k8s(_spec(tiny_config, "k8s", *METRICS, extra={"monitoring_namespace": "Team_A"}))
    with pytest.raises(ConfigError, match=r"^k8s\.grafana_admin_secret: "):
        render_k8s(_spec(tiny_config, "k8s", *METRICS, extra={"grafana_admin_secret": "a b"}))
    with pytest.raises(ConfigError, match=r"^onprem\.monitorin: unknown field; allowed: monitoring$"):
        render_onprem(_spec(tiny_config, "onprem", *METRICS, extra={"monitorin": False}))
    with pytest.raises(UserInputError, match=r"^onprem\.monitoring: true needs monitor\.metrics_port"):
        render_onprem(_spec(tiny_config, "onprem", extra={"monitoring": True}))
    assert "ansible/monitoring.yaml" not in render_onprem(_spec(tiny_config, "onprem", *METRICS,
                                                                extra={"monitoring": False}))  # fmt: skip


def test_bad_monitoring_option_through_the_cli_is_one_line(
    tiny_config: Path, tmp_path: Path, gaudi3_cli: Callable[..., tuple[int, str, str]]
) -> None:
    base = ["deploy", "render", "--accelerator", "gaudi3", "--nodes", "2", "--config", str(tiny_config),
            "--out", str(tmp_path / "out")]  # fmt: skip
    for target, extra in (("k8s", []), ("onprem", ["--hosts", "a,b"])):
        code, _, err = gaudi3_cli(*base, "--target", target, *extra, "--set", "monitoring=maybe")
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
        assert f"{target}.monitoring: " in err and "true or false" in err
    assert not (tmp_path / "out").exists()


def test_render_with_the_stack_end_to_end(tiny_config: Path, tmp_path: Path) -> None:
    """The real command in a subprocess, with the stack asked for explicitly."""
    config = tmp_path / "run.yaml"
    config.write_text(TINY + "monitor:\n  metrics_port: 0\n")  # 0: a free port per rank → 9100 + local rank
    done = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "deploy", "render", "--target", "k8s", "--accelerator", "h100",
         "--nodes", "2", "--per-node", "2", "--config", str(config), "--out", str(tmp_path / "out"),
         "--set", "monitoring=true", "--set", "grafana_admin_secret=ops-grafana"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    values = yaml.safe_load((out / MONITORING_FILES["values"]).read_text())
    assert values["grafana"]["admin"]["existingSecret"] == "ops-grafana"
    monitor = yaml.safe_load((out / MONITORING_FILES["podmonitor"]).read_text())
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics-0", "metrics-1"]


# Values that look like credentials: a generated password or token (20+ letters and digits in one word, 3+ of
# them digits, as the lookup makes them), a password in a URL, a password setting with a literal value.
_CREDENTIALS = re.compile(
    r"(?<![\w/.-])(?=(?:[A-Za-z+]*[0-9]){3})[A-Za-z0-9+]{20,}(?![\w/.-])"
    r"|://[^/\s:@]+:[^/\s@]+@"
    r"|(?i:password)['\"]?\s*[:=]\s*['\"]?\w"
)


def test_no_password_is_rendered(tiny_config: Path) -> None:
    files = {
        **render_k8s(_spec(tiny_config, "k8s", *METRICS)),
        **render_onprem(_spec(tiny_config, "onprem", *METRICS)),
    }
    for rel, text in files.items():
        assert not _CREDENTIALS.search(text), (rel, _CREDENTIALS.search(text))
    assert not [d for d in _objects(files) if d["kind"] == "Secret"]


# ---- onprem ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def onprem_files(tiny_config: Path) -> dict[str, str]:
    return render_onprem(_spec(tiny_config, "onprem", *METRICS))


def test_onprem_golden_files(onprem_files: dict[str, str]) -> None:
    for rel, parts in ASSET_COPIES.items():
        assert onprem_files[rel] == asset_text(*parts)  # as shipped, not a copy kept here
    files = {rel: text for rel, text in onprem_files.items() if rel not in ASSET_COPIES}
    if os.environ.get("GAUDI3_UPDATE_GOLDEN") == "1":
        shutil.rmtree(GOLDEN, ignore_errors=True)
        for rel, text in files.items():
            (GOLDEN / rel).parent.mkdir(parents=True, exist_ok=True)
            (GOLDEN / rel).write_text(text)
    golden = {p.relative_to(GOLDEN).as_posix(): p.read_text() for p in GOLDEN.rglob("*") if p.is_file()}
    assert sorted(files) == sorted(golden), "rendered file set changed (GAUDI3_UPDATE_GOLDEN=1 to regenerate)"
    for rel, text in files.items():
        assert text == golden[rel], (
            f"{rel} differs from its golden file (GAUDI3_UPDATE_GOLDEN=1 to regenerate)"
        )


def test_onprem_scrape_config_passes_promtool(
    onprem_files: dict[str, str], tmp_path: Path, tiny_config: Path
) -> None:
    for name in ("prometheus.yml", "alerts.yml"):
        (tmp_path / name).write_text(onprem_files[f"ansible/files/monitoring/{name}"])
    report = _promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert "SUCCESS: 11 rules found" in report and "valid prometheus config file syntax" in report
    config = yaml.safe_load(onprem_files["ansible/files/monitoring/prometheus.yml"])
    jobs = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    hosts = ["gpu-a.lab", "10.1.2.3", "[fd00::3]"]
    assert jobs[METRICS_JOB] == [
        f"{h}:{9100 + i}" for h in hosts for i in range(4)
    ]  # every rank of every node
    assert jobs["gaudi-metric-exporter"] == [f"{h}:41611" for h in hosts]  # Gaudi nodes: Intel's exporter
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9093"]
    # The ranks serve on those ports, on every interface (the rendered run config says so).
    monitor = yaml.safe_load(onprem_files["ansible/files/run.yaml"])["monitor"]
    assert (monitor["metrics_port"], monitor["metrics_host"]) == (9100, "0.0.0.0")
    gpu = render_onprem(_spec(tiny_config, "onprem", *METRICS, accelerator="h100"))
    gpu_jobs = [
        j["job_name"]
        for j in yaml.safe_load(gpu["ansible/files/monitoring/prometheus.yml"])["scrape_configs"]
    ]
    assert gpu_jobs == [METRICS_JOB, "dcgm"]


def test_onprem_services_pin_their_images_and_keep_the_stack_local(onprem_files: dict[str, str]) -> None:
    units = {rel.rsplit("/", 1)[1]: text for rel, text in onprem_files.items() if rel.endswith(".service")}
    stack = {k: v for k, v in units.items() if k != "gaudi3-train.service"}
    assert set(stack) == {
        "gaudi3-prometheus.service",
        "gaudi3-alertmanager.service",
        "gaudi3-grafana.service",
    }
    assert PROMETHEUS_IMAGE in stack["gaudi3-prometheus.service"]
    assert "--web.listen-address=127.0.0.1:9090" in stack["gaudi3-prometheus.service"]
    assert ALERTMANAGER_IMAGE in stack["gaudi3-alertmanager.service"]
    assert "--web.listen-address=127.0.0.1:9093" in stack["gaudi3-alertmanager.service"]
    assert GRAFANA_IMAGE in stack["gaudi3-grafana.service"]
    assert "--env-file /etc/gaudi3/monitoring/grafana.env" in stack["gaudi3-grafana.service"]
    inventory = yaml.safe_load(onprem_files["ansible/inventory.yaml"])["all"]["children"]["gaudi3_monitoring"]
    assert list(inventory["hosts"]) == [HOSTS[0]] and inventory["vars"]["gaudi3_alert_webhook_url"] == ""
    assert "credentials/" in onprem_files["ansible/.gitignore"]


def _ansible_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "ansible-home"
    return {**os.environ, "ANSIBLE_HOME": str(home), "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
            "ANSIBLE_NOCOLOR": "1", "ANSIBLE_RETRY_FILES_ENABLED": "0",
            "LC_ALL": "C.UTF-8"}  # fmt: skip  # Ansible refuses a locale that is not UTF-8


def _ansible(tool: str, *args: str, cwd: Path, env: dict[str, str]) -> str:
    beside = Path(sys.executable).parent / tool  # the venv's, when it is not activated
    path = str(beside) if beside.exists() else shutil.which(tool)
    if path is None:
        missing_system_tool(f"{tool} is not installed (the `test` extra has ansible-core)")
    done = subprocess.run([str(path), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


CHECK_PLAY = """\
- name: What monitoring.yaml writes from the inventory, rendered here
  hosts: gaudi3_monitoring
  connection: local
  gather_facts: false
  tasks:
    - ansible.builtin.template: {src: templates/monitoring/alertmanager.yml.j2, dest: "{{ out }}/alertmanager.yml"}
    - ansible.builtin.copy: {content: "{{ gaudi3_grafana_admin_password }}", dest: "{{ out }}/password"}
"""


def test_onprem_playbooks_with_ansible(onprem_files: dict[str, str], tmp_path: Path) -> None:
    root = tmp_path / "render"
    for rel, text in onprem_files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    ansible, env = root / "ansible", _ansible_env(tmp_path)
    _ansible("ansible-playbook", "--syntax-check", "-i", "inventory.yaml", "playbook.yaml", "monitoring.yaml",
             cwd=ansible, env=env)  # fmt: skip
    # Every task's module arguments are options of that module (syntax-check resolves the module names only).
    (play,) = yaml.safe_load(onprem_files["ansible/monitoring.yaml"])
    tasks = play["tasks"] + play["handlers"]
    used = {m: t[m] for t in tasks for m in t if m.startswith("ansible.builtin.")}
    docs = json.loads(_ansible("ansible-doc", "--json", *sorted(used), cwd=ansible, env=env))
    sources = set()
    for task in tasks:
        (module,) = [m for m in task if m.startswith("ansible.builtin.")]
        args = task[module] if isinstance(task[module], dict) else {}
        options = docs[module]["doc"].get("options", {})
        assert set(args) <= set(options), (task["name"], set(args) - set(options))
        if "src" in args:  # the files the play installs, its loops expanded as Ansible does
            sources |= {jinja2.Template(args["src"]).render(item=i) for i in task.get("loop", [None])}
    # Every file the play installs is rendered, and every rendered one is installed.
    assert {f"ansible/{src}" for src in sources} == {rel for rel in onprem_files if "/monitoring/" in rel}
    # The Alertmanager template and the password lookup, run by Ansible; a hostile URL stays one string.
    out = tmp_path / "out"
    out.mkdir()
    (ansible / "check.yaml").write_text(CHECK_PLAY)
    url = 'https://hooks.example/x?a="b"\n  - evil: 1'
    extra = json.dumps(
        {"out": str(out), "ansible_python_interpreter": sys.executable, "gaudi3_alert_webhook_url": url}
    )
    _ansible("ansible-playbook", "-i", "inventory.yaml", "check.yaml", "-e", extra, cwd=ansible, env=env)
    config = yaml.safe_load((out / "alertmanager.yml").read_text())
    (receiver,) = config["receivers"]
    assert config["route"]["receiver"] == receiver["name"]
    assert receiver["webhook_configs"] == [{"url": url, "send_resolved": True}]
    password = (out / "password").read_text()
    stored = ansible / "credentials" / "grafana-admin-password"
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password) and stored.read_text().strip() == password
    assert stored.stat().st_mode & 0o777 == 0o600 and stored.parent.stat().st_mode & 0o777 == 0o700
