"""`gaudi3 ckpt list | verify | diff | export`: checkpoints inspected and exported without training."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from gaudi3_scale.checkpoint.contents import DIFF_KEYS
from gaudi3_scale.config.errors import UserInputError

__all__ = ["ckpt"]


def _checkpoints_dir(path: Path) -> Path:
    """A run directory or its checkpoints/ directory → the checkpoints/ directory."""
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    if not path.is_dir():
        raise UserInputError(f"{str(path)!r} is not a directory; pass a run directory or its checkpoints/")
    return path


def _refuse_no_checkpoints(directory: Path) -> None:
    from gaudi3_scale.checkpoint.manifest import has_manifest

    if has_manifest(directory):
        raise UserInputError(
            f"{str(directory)!r} is one checkpoint, not a run; pass its run directory or checkpoints/ (or check "
            "it alone with `gaudi3 ckpt verify`)"
        )
    raise UserInputError(
        f"{str(directory)!r} holds no checkpoints (no step-* directories, no checkpoints/); pass a run directory "
        "or its checkpoints/"
    )


def _refuse_unless_run(checkpoints: Path) -> None:
    """For a directory that holds no step-* directories: a run's checkpoints/ (none saved yet) is accepted, empty;
    anything else is refused (`_refuse_no_checkpoints`)."""
    if checkpoints.name != "checkpoints":
        _refuse_no_checkpoints(checkpoints)


def _warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


@click.group()
def ckpt() -> None:
    """List, verify, compare and export checkpoints."""


@ckpt.command(name="list")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--verify", is_flag=True, help="also check every file's size and SHA-256")
def list_cmd(directory: Path, verify: bool) -> None:
    """The checkpoints of a run (a run directory or its checkpoints/); exit 1 if any is damaged or uncommitted
    (a damaged manifest shows without --verify; a damaged file only with it)."""
    from rich.console import Console
    from rich.table import Table

    from gaudi3_scale.checkpoint.inspect import checkpoint_rows

    checkpoints = _checkpoints_dir(directory)
    rows = checkpoint_rows(checkpoints, verify=verify)
    if not rows:
        _refuse_unless_run(checkpoints)
    table = Table(title=str(directory))
    for column in ("step", "status", "latest", "size (MB)", "tokens seen", "ranks", "strategy", "val loss"):
        table.add_column(column)
    for r in rows:
        size = f"{r['size_bytes'] / 1e6:,.1f}" if r["size_bytes"] is not None else "-"
        val = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "-"
        tokens = f"{r['tokens_seen']:,}" if r["tokens_seen"] is not None else "-"
        table.add_row(str(r["step"]), r["status"], "*" if r["latest"] else "", size, tokens,
                      str(r["world_size"] or "-"), str(r["strategy"] or "-"), val)  # fmt: skip
    Console().print(table)
    if any(r["status"] not in ("ok", "-") for r in rows):  # damaged or uncommitted ("-": not verified)
        sys.exit(1)


@ckpt.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
def verify(paths: tuple[Path, ...]) -> None:
    """Check checkpoints against their manifests (a run directory: each of its checkpoints, none yet is no
    problem); exit 1 if any is damaged or uncommitted."""
    from gaudi3_scale.checkpoint.manifest import verify_checkpoint

    directories: list[Path] = []
    for path in paths:
        found = _checkpoints_to_verify(path)
        if not found:
            click.echo(f"{path}: no checkpoints")
        directories += found
    bad = 0
    for directory in directories:
        problems = verify_checkpoint(directory)
        click.echo(f"{directory}: " + ("ok" if not problems else "; ".join(problems)))
        bad += bool(problems)
    if bad:
        sys.exit(1)


def _checkpoints_to_verify(path: Path) -> list[Path]:
    """The checkpoint directories `ckpt verify PATH` checks: a step-X directory (or its state.ckpt, or a `latest`
    pointer) itself, committed or not; each step-X of a run; none for a run that has saved none yet. Anything else
    is one line, exit 2."""
    from gaudi3_scale.checkpoint.manager import CheckpointManager, resolve_checkpoint
    from gaudi3_scale.checkpoint.manifest import STATE_NAME, has_manifest
    from gaudi3_scale.checkpoint.sharded import is_sharded

    if path.is_file() or not path.exists():
        directory = resolve_checkpoint(path)  # a missing path, a pointer naming nothing: one line
        if directory.is_file():
            raise UserInputError(
                f"{str(path)!r} is a file: only a checkpoint directory has a manifest to verify against; pass a "
                "step-X directory or a run directory written by `gaudi3 train`"
            )
        return [directory]
    named_as_step = path in [step for _, step in CheckpointManager(path.parent).steps()]
    if has_manifest(path) or named_as_step or (path / STATE_NAME).exists() or is_sharded(path):
        return [path]  # a checkpoint (an uncommitted one is reported as such)
    checkpoints = _checkpoints_dir(path)
    steps = CheckpointManager(checkpoints).steps()
    if not steps:
        _refuse_unless_run(checkpoints)
    return [step for _, step in steps]


@ckpt.command()
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
def diff(a: Path, b: Path) -> None:
    """Compare two checkpoints tensor by tensor (bitwise); print the first difference, exit 1 if there is one.

    A or B may be a run directory: its newest checkpoint that verifies."""
    from gaudi3_scale.checkpoint.inspect import first_difference, shared_keys
    from gaudi3_scale.checkpoint.manager import resolve_checkpoint
    from gaudi3_scale.checkpoint.reader import read_checkpoint

    a, b = resolve_checkpoint(a, warn=_warn), resolve_checkpoint(b, warn=_warn)
    state_a, state_b = read_checkpoint(a), read_checkpoint(b)
    found = first_difference(state_a, state_b, keys=DIFF_KEYS)
    if found is None:  # entries on neither side (a light checkpoint's optimizer state) are not named
        click.echo(
            f"identical: {', '.join(shared_keys(state_a, state_b, keys=DIFF_KEYS)) or 'nothing to compare'}"
        )
        return
    click.echo(f"first difference: {found.key}: {found.detail}")
    sys.exit(1)


@ckpt.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="directory to write (absent or empty)",
)
@click.option(
    "--format",
    "fmt",
    # = artifacts.export.EXPORT_FORMATS (a test checks), spelled out because importing that module loads torch
    type=click.Choice(["safetensors", "hf"]),
    default="safetensors",
    show_default=True,
    help="safetensors: model.safetensors + model_config.json, our names; "
    "hf: config.json + model.safetensors for transformers' LlamaForCausalLM, MixtralForCausalLM or "
    "BertForMaskedLM (llama, llama with experts, and bert models)",
)
@click.option("--force", is_flag=True, help="replace a non-empty --out directory")
@click.option(
    "--tokenizer",
    "tokenizer_dir",
    type=click.Path(path_type=Path),
    help="directory holding tokenizer.json (default: the run's tokenizer/)",
)
@click.option(
    "--register",
    "register_name",
    metavar="NAME",
    help="also register the export as a new version of model NAME in an MLflow model registry",
)
@click.option(
    "--tracking-uri",
    metavar="URI",
    help="MLflow tracking/registry URI for --register (default: $MLFLOW_TRACKING_URI, else <run>/mlruns)",
)
@click.option(
    "--experiment", default="gaudi3-exports", show_default=True, help="MLflow experiment for --register"
)
def export(
    checkpoint: Path,
    out_dir: Path,
    fmt: str,
    force: bool,
    tokenizer_dir: Path | None,
    register_name: str | None,
    tracking_uri: str | None,
    experiment: str,
) -> None:
    """Write a checkpoint's model weights (a run directory: its newest checkpoint that verifies) as one
    safetensors file, or as a Hugging Face Llama, Mixtral or BERT directory."""
    from gaudi3_scale.artifacts.export import export_checkpoint
    from gaudi3_scale.checkpoint.manager import resolve_checkpoint

    checkpoint = resolve_checkpoint(checkpoint, warn=_warn)

    client = uri = None
    metrics: dict[str, float] = {}
    if register_name is not None:  # checked before anything is written
        from gaudi3_scale.artifacts.register import check_registry, checkpoint_metrics, registry_uri

        # a damaged summary.json is refused here, before the registry or the export is made
        metrics = checkpoint_metrics(checkpoint)
        uri = registry_uri(checkpoint, tracking_uri)
        client = check_registry(register_name, uri)
    written = export_checkpoint(checkpoint, out_dir, fmt=fmt, force=force, tokenizer_dir=tokenizer_dir)
    size_mb = sum(path.stat().st_size for path in written) / 1e6
    names = ", ".join(path.relative_to(out_dir).as_posix() for path in written)
    click.echo(f"{out_dir}: {names} ({fmt}, {size_mb:,.1f} MB)")
    if register_name is not None:
        from gaudi3_scale.artifacts.register import register_export

        registered = register_export(
            out_dir, register_name, checkpoint=checkpoint, metrics=metrics, fmt=fmt, client=client,
            tracking_uri=str(uri), experiment=experiment,
        )  # fmt: skip
        click.echo(
            f"registered {registered.name} version {registered.version} in {registered.tracking_uri} "
            f"(MLflow run {registered.run_id}; artifacts {registered.source})"
        )
