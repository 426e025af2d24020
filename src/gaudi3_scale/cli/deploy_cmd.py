"""`gaudi3 deploy render|collect|plan|apply|destroy` (alias `gaudi3-deploy …`)."""

from __future__ import annotations

from pathlib import Path

import click

from gaudi3_scale.cli.options import Count
from gaudi3_scale.config.errors import UserInputError, brief, print_error
from gaudi3_scale.config.files import check_output_dir, parse_yaml_value

__all__ = ["deploy"]


@click.group()
def deploy() -> None:
    """Terraform, Kubernetes, container and Metaflow files from one training config; validated offline."""


@deploy.command(name="render")
@click.option("--target", required=True, help="aws, azure, gcp, onprem, k8s or ci")
@click.option("--accelerator", required=True, help="gaudi3, gaudi2, h100, h200 or a100")
@click.option("--nodes", type=Count(), required=True, help="machines (or pods) to train on")
@click.option(
    "--config", "config_path", required=True, type=click.Path(dir_okay=False), help="run config YAML"
)
@click.option(
    "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="directory to render into"
)
@click.option(
    "--per-node", type=Count(), help="accelerators per node (default: the catalog instance's, else 8)"
)
@click.option("--image", help="container image the nodes run (default: gaudi3-scale-train:<version>)")
@click.option("--region", help="cloud region (default: the catalog instance's)")
@click.option("--hosts", help="onprem: comma-separated host names or addresses, the first one is the master")
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="KEY=VALUE",
    help="a target option, repeatable (k8s: namespace, storage, cpu, memory, max_restarts, monitoring, …; onprem: "
    "monitoring; ci: registry, image_name, platforms, smoke_runs_on, …); every key with its default and meaning: "
    "docs/reference/deploy_options.md",
)
@click.option(
    "--force",
    is_flag=True,
    help="overwrite rendered files that differ, and remove those an earlier render of the target wrote that "
    "this one does not (both are refused otherwise)",
)
def render_cmd(
    target: str,
    accelerator: str,
    nodes: int,
    config_path: str,
    out_dir: str,
    per_node: int | None,
    image: str | None,
    region: str | None,
    hosts: str | None,
    settings: tuple[str, ...],
    force: bool,
) -> None:
    """Render the deployment of CONFIG on NODES machines with ACCELERATOR for TARGET into OUT."""
    from gaudi3_scale.deploy.node_command import deployment_run_config
    from gaudi3_scale.deploy.render import render, write_files
    from gaudi3_scale.deploy.spec import DeploySpec, default_image, default_per_node, resource_name

    if not Path(config_path).is_file():
        raise UserInputError(f"--config: {config_path} is not a file")
    if per_node is None:
        per_node = default_per_node(target, accelerator)
    extra, host_names = _settings(settings), _hosts(hosts)  # the flags' own syntax before the config's
    # the file on this deployment's nodes × per_node ranks: one line naming what it would refuse
    run_name, run_config = deployment_run_config(config_path, nodes=nodes, per_node=per_node)
    name = resource_name(run_name)
    spec = DeploySpec(
        target=target,
        accelerator=accelerator,
        nodes=nodes,
        per_node=per_node,
        config_path=Path(config_path),
        run_config=run_config,
        name=name,
        image=default_image(accelerator) if image is None else image,  # '' is refused, not the default
        region=region,
        hosts=host_names,
        extra=extra,
    )
    files = render(spec)
    written, removed = write_files(files, Path(out_dir), force=force, record=target)
    if name != run_name:
        click.echo(f"resource name: {name} (the run name {run_name!r} as cloud and Kubernetes names allow)")
    gone = f", {len(removed)} an earlier render wrote removed" if removed else ""
    click.echo(
        f"{len(files)} file(s) for {target} ({len(written)} written{gone}, the rest unchanged) → {out_dir}/"
    )


def _settings(items: tuple[str, ...]) -> dict[str, object]:
    """--set KEY=VALUE pairs; values are read as YAML (3 → int, true → bool, text that is not YAML stays text),
    with the limits of every config value (nesting, aliases, integer length)."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserInputError(f"--set: expected KEY=VALUE, got {brief(item)}")
        out[key.strip()] = parse_yaml_value(value, field=f"--set {key.strip()}") if value.strip() else ""
    return out


@deploy.command(name="collect")
@click.argument("logs", nargs=-1, type=click.Path(dir_okay=False))
@click.option(
    "--job", help="read the pod logs of this Kubernetes Job / PyTorchJob (with kubectl) instead of files"
)
@click.option("--namespace", help="the job's namespace (default: kubectl's current one)")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="results directory")
def collect_cmd(logs: tuple[str, ...], job: str | None, namespace: str | None, out_dir: str) -> None:
    """Benchmark results a deployed run printed (GAUDI3-BENCHMARK-RESULT markers) from LOG files or a job's pods,
    written as `gaudi3 benchmark collect` does (OUT/cells/<id>/result.json)."""
    from gaudi3_scale.bench.collect import save_collected
    from gaudi3_scale.deploy.collect import collect_results

    if namespace and not job:
        raise UserInputError("--namespace: only with --job NAME (log files carry no namespace)")
    check_output_dir("--out", out_dir)  # before kubectl: a typo in --out costs no cluster round trip
    results = collect_results([Path(p) for p in logs], job, namespace)  # at least one, or UserInputError
    for line in save_collected(results, Path(out_dir)).lines():
        click.echo(line)


_PATHS = click.argument("paths", nargs=-1, required=True, type=click.Path())
_YES = click.option("--yes", is_flag=True, help="run the changing commands without asking")


@deploy.command(name="plan")
@_PATHS
def plan_cmd(paths: tuple[str, ...]) -> None:
    """Show what `apply` would change, changing nothing: terraform init + plan in a directory of *.tf files, or
    kubectl apply --dry-run=server + diff for Kubernetes manifests (files or directories)."""
    _tool("plan", paths, yes=False)


@deploy.command(name="apply")
@_PATHS
@_YES
def apply_cmd(paths: tuple[str, ...], yes: bool) -> None:
    """Create or update the deployment (terraform apply, or kubectl apply) after a preview: with --yes, or a yes
    at the prompt; with neither and no terminal to ask, print the commands and exit 2."""
    _tool("apply", paths, yes=yes)


@deploy.command(name="destroy")
@_PATHS
@_YES
def destroy_cmd(paths: tuple[str, ...], yes: bool) -> None:
    """Delete the deployment (terraform destroy, or kubectl delete): with --yes, or a yes at the prompt."""
    _tool("destroy", paths, yes=yes)


def _tool(action: str, paths: tuple[str, ...], *, yes: bool) -> None:
    import sys

    from gaudi3_scale.deploy.tools import ToolFailed, execute, find_deployment

    deployment = find_deployment([Path(p) for p in paths])
    confirm = (lambda q: click.confirm(q, default=False)) if sys.stdin.isatty() else None
    try:
        done = execute(deployment, action, yes=yes, confirm=confirm, echo=click.echo)
    except ToolFailed as exc:
        print_error(str(exc))
        raise SystemExit(1) from None
    if not done:
        raise SystemExit(1)


def _hosts(hosts: str | None) -> tuple[str, ...]:
    """--hosts as names; an empty entry (`a,,b`, a trailing comma) is a typo that would drop a node."""
    if hosts is None:
        return ()
    names = tuple(h.strip() for h in hosts.split(","))
    if not all(names):
        raise UserInputError(f"--hosts: {hosts!r} has an empty entry; pass comma-separated host names")
    return names
