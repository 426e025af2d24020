"""The renderer registry and the one function that writes rendered files.

A renderer takes a `DeploySpec` and returns {relative path: file text}; `register_renderer` adds one per target
(plain registry, filled by the target modules when `renderers()` first imports them), with the dataclass its
`--set KEY=VALUE` options are read into when it takes any (`target_options`; the options reference page is made
from them). `write_files` never
overwrites a file that differs unless told to, so a user's edits to a rendered tree are not lost silently.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.config.files import check_output_dir
from gaudi3_scale.deploy.spec import DeploySpec

__all__ = [
    "CONTAINERS",
    "Renderer",
    "check_run_geometry",
    "register_renderer",
    "render",
    "renderers",
    "target_options",
    "write_files",
]

Renderer = Callable[[DeploySpec], dict[str, str]]
_RENDERERS: dict[str, Renderer] = {}
_OPTIONS: dict[str, type] = {}  # target: the dataclass of its `DeploySpec.extra` (--set KEY=VALUE)
# The modules that register renderers, imported on first use (each needs only the standard library and yaml).
_MODULES = (
    "gaudi3_scale.deploy.kubernetes",
    "gaudi3_scale.deploy.terraform",
    "gaudi3_scale.deploy.onprem",
    "gaudi3_scale.deploy.containers",
    "gaudi3_scale.deploy.ci",
)
CONTAINERS = "containers"  # not a target: the image files every target's nodes run, rendered with each target


def register_renderer(target: str, renderer: Renderer, *, options: type | None = None) -> None:
    """`options`: the dataclass the target reads `DeploySpec.extra` into; a target without one refuses --set."""
    if target in _RENDERERS:
        raise ValueError(f"a renderer for {target!r} is registered already")
    _RENDERERS[target] = renderer
    if options is not None:
        _OPTIONS[target] = options


def renderers() -> dict[str, Renderer]:
    for module in _MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    return dict(_RENDERERS)


def target_options() -> dict[str, type]:
    """The targets that take --set KEY=VALUE, each with the dataclass of its options."""
    renderers()
    return dict(_OPTIONS)


def render(spec: DeploySpec) -> dict[str, str]:
    """Every file of `spec`'s target: the target's own files plus the container files all targets ship."""
    found = renderers()
    if spec.target not in found:
        available = ", ".join(sorted(set(found) - {CONTAINERS}))
        raise UserInputError(f"--target {spec.target}: no renderer yet; available: {available}")
    if spec.extra and spec.target not in _OPTIONS:
        raise UserInputError(
            f"--set: --target {spec.target} takes no options (only {', '.join(sorted(_OPTIONS))} take them); "
            "its settings are Terraform / Ansible variables in the rendered files"
        )
    check_run_geometry(spec)
    files = dict(found[spec.target](spec))
    if CONTAINERS in found:
        files.update(found[CONTAINERS](spec))
    return files


# Targets whose nodes keep --out on their own disks: the Terraform VMs (checkpoints go to the bucket they create).
NODE_LOCAL_OUT = ("aws", "azure", "gcp")


def check_run_geometry(spec: DeploySpec) -> None:
    """The run config must train on nodes × per_node ranks (e.g. its global batch must split over them): refused
    here in one line, not by every node after it booted."""
    from gaudi3_scale.config.errors import ConfigError
    from gaudi3_scale.train.config import build_run_config  # no torch behind it

    overrides = [
        ("parallel.nnodes", str(spec.nodes)),
        ("parallel.nproc_per_node", str(spec.per_node)),
        ("parallel.node_rank", "0"),
        ("parallel.rdzv_endpoint", "node-0:29500"),
    ]
    try:
        # the whole config as the base, as a node's `gaudi3 train --config run.yaml` reads it (max_steps null
        # beside max_epochs: `config_dict`)
        cfg = build_run_config(None, overrides, base=spec.run_config)
    except ConfigError as exc:
        raise UserInputError(f"{spec.nodes} node(s) × {spec.per_node} per node: {exc}") from None
    if spec.accelerator.startswith("gaudi"):
        from gaudi3_scale.forecast.run import check_runs_on

        check_runs_on(
            cfg, "hpu"
        )  # what every rank would refuse at start (DeepSpeed, reduce-overhead, 16-mixed)
    if spec.target in NODE_LOCAL_OUT and spec.nodes > 1 and cfg.checkpoint.enabled:
        from gaudi3_scale.train.config import per_rank_checkpoints

        if (setting := per_rank_checkpoints(cfg.parallel)) is not None:
            raise UserInputError(
                f"--target {spec.target}: each node keeps the run's --out on its own disk (its checkpoints are "
                f"mirrored to the bucket by rank 0), but with {setting} every rank writes its part of each "
                f"checkpoint there for rank 0 to commit, which {spec.nodes} nodes cannot (the run would refuse to "
                "start); use --target k8s (a volume every node mounts), --nodes 1, or parallel.strategy ddp"
            )


def write_files(files: Mapping[str, str], out_dir: Path, *, force: bool = False) -> list[Path]:
    """Write `files` under `out_dir` (each atomically). A file that exists with other content is refused (one
    line naming it) unless `force`; identical files are left alone. Everything that would stop a write (a file
    where a directory goes, a directory where a file goes, a link out of `out_dir`) is refused before any file
    is written."""
    check_output_dir("--out", out_dir)
    root = out_dir.resolve()
    targets = {}
    for rel, text in files.items():
        path = (root / rel).resolve()
        if root not in path.parents:
            raise UserInputError(f"--out: {rel} would be written through a link out of {str(out_dir)!r}")
        check_output_dir("--out", path.parent)
        if path.exists() and not path.is_file():
            raise UserInputError(
                f"--out: {str(path)!r} is in the way of a rendered file (not a regular file)"
            )
        targets[path] = text.encode()
    clashes = [p for p, data in targets.items() if p.exists() and p.read_bytes() != data]
    if clashes and not force:
        raise UserInputError(
            f"{clashes[0]} exists and differs from what would be rendered ({len(clashes)} such file(s)); "
            "render into a new --out directory, or pass --force to overwrite"
        )
    written = []
    try:
        for path, data in sorted(targets.items()):
            if path.exists() and path.read_bytes() == data:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)
            written.append(path)
    except OSError as exc:  # the file system refused (read-only, /proc, full): one line, naming the path
        raise UserInputError(
            f"--out: cannot write {exc.filename or out_dir} ({exc.strerror or exc})"
        ) from None
    return written
