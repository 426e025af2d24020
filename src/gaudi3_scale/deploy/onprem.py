"""`gaudi3 deploy render --target onprem --hosts a,b,c`: an Ansible inventory and playbook for machines you own.

The first host is the master (node_rank 0, the c10d rendezvous on port 29500); each host gets its node_rank in the
inventory. The playbook installs the node files of `deploy/bootstrap.py` (run config, node.env, the run script, a
systemd unit) and starts the unit, which runs the training image with Docker: `cd ansible && ansible-playbook -i
inventory.yaml playbook.yaml`. The machines need Docker and the accelerator's container runtime (the habana runtime for Gaudi,
the NVIDIA container toolkit for GPUs), and must reach each other on every port (NCCL / HCCL pick theirs).

Secrets are never rendered: each host reads them from `gaudi3_secrets_env_file` (default /etc/gaudi3/secrets.env,
NAME=value lines, mode 0600), which you provision yourself, e.g. from an Ansible Vault. Checkpoints go where the run
config's `checkpoint.remote_url` says (no bucket is created here).

When the run config sets `monitor.metrics_port` (or `--set monitoring=true`), a second playbook, `monitoring.yaml`,
runs Prometheus, Alertmanager and Grafana for the job (`onprem_monitoring.py`); the rendered run.yaml then binds the
ranks' metrics to 0.0.0.0 so that they can be scraped from the monitoring host.
"""

from __future__ import annotations

import copy
import dataclasses
import ipaddress

from gaudi3_scale.config.core import from_dict
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.deploy.bootstrap import (
    RDZV_PORT,
    node_env,
    node_slots,
    run_config_yaml,
    run_script,
    systemd_unit,
)
from gaudi3_scale.deploy.containers import IMAGE_UID, NOT_VALIDATED
from gaudi3_scale.deploy.monitoring import metrics_port, monitoring_on
from gaudi3_scale.deploy.onprem_monitoring import (
    MONITORING_GROUP,
    OnpremOptions,
    monitoring_files,
    monitoring_inventory_group,
)
from gaudi3_scale.deploy.quoting import yaml_text
from gaudi3_scale.deploy.render import register_renderer
from gaudi3_scale.deploy.spec import DeploySpec

__all__ = ["render_onprem"]

GROUP = "gaudi3_nodes"
ANSIBLE_DIR = "ansible"  # the rendered playbook's directory under --out (beside docker/)

PLAYBOOK = """# Starts the gaudi3-scale training job on every host of inventory.yaml, rendered by `gaudi3 deploy render
# --target onprem`:  ansible-playbook -i inventory.yaml playbook.yaml
# Each host runs its ranks in the training image (gaudi3-train.service); secrets come from
# gaudi3_secrets_env_file on the host, which you provision (e.g. from an Ansible Vault), never from these files.
- name: Start gaudi3-scale training on every node
  hosts: gaudi3_nodes
  become: true
  tasks:
    - name: Check that Docker is installed
      ansible.builtin.command: docker --version
      changed_when: false

    - name: Create the config directory
      ansible.builtin.file:
        path: /etc/gaudi3
        state: directory
        owner: root
        group: root
        mode: "0755"

    - name: Create the workspace the container's user writes outputs and checkpoints to
      ansible.builtin.file:
        path: /var/lib/gaudi3
        state: directory
        owner: "{IMAGE_UID}"
        group: "{IMAGE_UID}"
        mode: "0750"

    - name: Install the run config
      ansible.builtin.copy:
        src: files/run.yaml
        dest: /etc/gaudi3/run.yaml
        owner: root
        group: root
        mode: "0644"
      notify: Restart training

    - name: Install this node's rank and the master's address
      ansible.builtin.template:
        src: templates/node.env.j2
        dest: /etc/gaudi3/node.env
        owner: root
        group: root
        mode: "0644"
      notify: Restart training

    - name: Install the node's run script
      ansible.builtin.copy:
        src: files/gaudi3-node
        dest: /usr/local/bin/gaudi3-node
        owner: root
        group: root
        mode: "0755"
      notify: Restart training

    - name: Install the training service
      ansible.builtin.copy:
        src: files/gaudi3-train.service
        dest: /etc/systemd/system/gaudi3-train.service
        owner: root
        group: root
        mode: "0644"
      notify: Restart training

    - name: Pull the training image
      ansible.builtin.command: docker pull {{ gaudi3_image | quote }}
      register: pull
      changed_when: "'Downloaded newer image' in pull.stdout"
      notify: Restart training

    - name: Start training (now and at boot)
      ansible.builtin.systemd_service:
        name: gaudi3-train.service
        enabled: true
        state: started
        daemon_reload: true

  handlers:
    - name: Restart training
      ansible.builtin.systemd_service:
        name: gaudi3-train.service
        state: restarted
        daemon_reload: true
"""


def _check_hosts(spec: DeploySpec) -> tuple[str, ...]:
    example = ",".join(f"node{i}" for i in range(1, min(spec.nodes, 3) + 1))
    if not spec.hosts:
        raise UserInputError(
            f"--hosts: onprem needs the machines to train on, one per node, the first is the master "
            f"(e.g. --hosts {example})"
        )
    if len(spec.hosts) != spec.nodes:
        raise UserInputError(
            f"--hosts: {len(spec.hosts)} host(s) for --nodes {spec.nodes}; give exactly one host per node "
            f"(the first is the master)"
        )
    # Each host's grammar is checked where the spec is built (DeploySpec: host name or IP address).
    if len(set(spec.hosts)) != len(spec.hosts):
        twice = sorted({h for h in spec.hosts if spec.hosts.count(h) > 1})
        raise UserInputError(f"--hosts: {twice[0]!r} is listed twice; give each machine once")
    return spec.hosts


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _rdzv_host(host: str) -> str:
    """The master as it goes into HOST:PORT (an IPv6 address in brackets)."""
    return f"[{host}]" if _is_address(host) and ipaddress.ip_address(host).version == 6 else host


def _monitoring_port(spec: DeploySpec) -> int | None:
    """The first metrics port of each node when the monitoring stack is rendered, else None."""
    opts = from_dict(OnpremOptions, spec.extra, prefix="onprem")
    configured = spec.run_config.get("monitor", {}).get("metrics_port")
    port = metrics_port(configured, spec.per_node, rdzv_port=RDZV_PORT, rdzv_field="the rendezvous port")
    return port if monitoring_on(opts.monitoring, port, "onprem.monitoring") else None


def _scrapeable(spec: DeploySpec, port: int) -> DeploySpec:
    """`spec` with its ranks' metrics on `port` + local rank and bound to every interface, for the monitoring host."""
    run_config = copy.deepcopy(spec.run_config)
    run_config.setdefault("monitor", {}).update(metrics_port=port, metrics_host="0.0.0.0")
    return dataclasses.replace(spec, run_config=run_config)


def _gaudi_note(spec: DeploySpec) -> str:
    if not spec.accelerator.startswith("gaudi"):
        return ""
    return f"# {spec.accelerator}: the hosts run the training image with Habana's container runtime; {NOT_VALIDATED}.\n"


def render_onprem(spec: DeploySpec) -> dict[str, str]:
    hosts = _check_hosts(spec)
    port = _monitoring_port(spec)
    if port is not None:
        spec = _scrapeable(spec, port)
    inventory = {
        "all": {
            "children": {
                GROUP: {
                    "hosts": {host: {"node_rank": rank} for rank, host in enumerate(hosts)},
                    "vars": {
                        "gaudi3_master_addr": _rdzv_host(hosts[0]),
                        "gaudi3_nnodes": spec.nodes,
                        "gaudi3_nproc_per_node": spec.per_node,
                        "gaudi3_image": spec.image,
                        "gaudi3_secrets_env_file": "/etc/gaudi3/secrets.env",
                    },
                }
            }
        }
    }
    header = (
        f"# The machines of {spec.name}, rendered by `gaudi3 deploy render --target onprem`: node_rank 0 is the\n"
        f"# master (c10d rendezvous on port {RDZV_PORT}). Add ansible_user / ansible_host per host as you need.\n"
    )
    if port is not None:
        inventory["all"]["children"][MONITORING_GROUP] = monitoring_inventory_group(hosts[0])
        header += (
            f"# {MONITORING_GROUP}: the machine monitoring.yaml runs Prometheus, Alertmanager and Grafana on (the\n"
            "# master here; any host that reaches every node). FILL IN gaudi3_alert_webhook_url, where alerts are\n"
            "# posted (a secret: ansible-vault encrypt_string). gaudi3_grafana_admin_password is generated into\n"
            "# credentials/ on the first run; set it to a vault variable to choose it.\n"
        )
    env = node_env(
        node_rank="{{ node_rank }}",
        nnodes="{{ gaudi3_nnodes }}",
        nproc_per_node="{{ gaudi3_nproc_per_node }}",
        rdzv_host="{{ gaudi3_master_addr }}",
        image="{{ gaudi3_image }}",
        checkpoint_url="",  # the run config's checkpoint.remote_url, unchanged
        secrets_env_file="{{ gaudi3_secrets_env_file }}",
    )
    files = {
        "inventory.yaml": header + yaml_text(inventory),
        "playbook.yaml": _gaudi_note(spec) + PLAYBOOK.replace("{IMAGE_UID}", str(IMAGE_UID)),
        "files/run.yaml": run_config_yaml(spec),
        # checkpoints go where the run config's checkpoint.remote_url says (no bucket is created here)
        "files/gaudi3-node": run_script(
            spec, node_slots(spec, rdzv_host=_rdzv_host(hosts[0]), checkpoint_url=None)
        ),
        "files/gaudi3-train.service": systemd_unit(fetch_secrets=False),
        "templates/node.env.j2": "# {{ ansible_managed }}\n" + env,
    }
    if port is not None:
        addresses = [_rdzv_host(host) for host in hosts]
        files.update(
            monitoring_files(addresses, spec.per_node, port, gaudi=spec.accelerator.startswith("gaudi"))
        )
    return {f"{ANSIBLE_DIR}/{name}": text for name, text in files.items()}


register_renderer("onprem", render_onprem, options=OnpremOptions)
