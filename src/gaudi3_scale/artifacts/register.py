"""`gaudi3 ckpt export --register NAME`: an export as a new version of a model in an MLflow model registry.

One MLflow run per registration (experiment `gaudi3-exports` unless given) holds the export directory as the
artifact `model/`, the checkpoint's resolved config as parameters (`section.field`) and `config.yaml`, and its
metrics (step, tokens seen and validation loss from the checkpoint's manifest; the run's `summary.json` when there
is one). The model version points at that artifact and is tagged with the format, architecture, step and source
checkpoint. The registry is the tracking store itself: a local file store `<run>/mlruns` by default (as the
`mlflow` tracker uses), or any MLflow tracking URI (`--tracking-uri`, else `MLFLOW_TRACKING_URI`).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gaudi3_scale.checkpoint.contents import run_config
from gaudi3_scale.checkpoint.manager import LIGHT_DIR_NAME, checkpoint_directory
from gaudi3_scale.checkpoint.manifest import read_manifest
from gaudi3_scale.checkpoint.reader import read_checkpoint
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.config.files import load_json_file
from gaudi3_scale.models.counting import count_parameters
from gaudi3_scale.monitor.config import TRACKING_EXTRA

__all__ = [
    "DEFAULT_EXPERIMENT",
    "MODEL_URI_PREFIX",
    "RegisteredVersion",
    "check_registry",
    "checkpoint_metrics",
    "fetch_registered",
    "register_export",
    "registry_uri",
]

DEFAULT_EXPERIMENT = "gaudi3-exports"
# What the MLflow server and the file store both accept as a registered model name, and safe as a path part.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MODEL_URI_PREFIX = "models:/"  # MLflow's URI of a registered model version: models:/NAME/VERSION
_MODEL_URI = re.compile(r"models:/(?P<name>[^/]+)/(?P<version>[1-9][0-9]*)")
# Documented in mlflow.environment_variables: fail fast instead of retrying an unreachable server for minutes.
_HTTP_FAIL_FAST = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: int
    source: str  # the artifact URI the version points at
    run_id: str
    tracking_uri: str


def registry_uri(checkpoint: Path, tracking_uri: str | None = None) -> str:
    """`tracking_uri`, else `MLFLOW_TRACKING_URI`, else the file store `mlruns/` of the checkpoint's run directory."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    directory = checkpoint_directory(Path(checkpoint)).resolve()
    # <run>/checkpoints/step-X and <run>/light_checkpoints/step-X share one registry (and version numbers), as
    # they share the run's tokenizer/ (`run_tokenizer_dir`); any other checkpoint: the directory that holds it.
    in_run = directory.parent.name in ("checkpoints", LIGHT_DIR_NAME)
    run_dir = directory.parent.parent if in_run else directory.parent
    return (run_dir / "mlruns").as_uri()


def check_registry(name: str, uri: str, *, asked_by: str = "--register") -> Any:
    """An MlflowClient for `uri` after checking `name`, the package and that the store answers (before any export
    work), or one line saying what is wrong."""
    if not _NAME.fullmatch(name):
        raise UserInputError(
            f"{asked_by} {name!r} is not a usable model name: use letters, digits, '.', '_' or '-' "
            "(starting with a letter or digit, at most 128)"
        )
    try:
        import mlflow  # noqa: F401  (only to know it is there)
    except ImportError:
        raise UserInputError(f"{asked_by} needs MLflow: {TRACKING_EXTRA}") from None
    for key, value in _HTTP_FAIL_FAST.items():
        os.environ.setdefault(key, value)
    from mlflow.exceptions import MlflowException

    from gaudi3_scale.monitor.trackers import mlflow_client

    try:
        client = mlflow_client(uri)
        client.search_registered_models(max_results=1)
    except (MlflowException, OSError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        # Drop urllib3's retry story after "API request to … failed".
        detail = detail.split(" with exception")[0]
        raise UserInputError(
            f"MLflow registry at {uri!r} is not usable: {detail[:300]}; pass --tracking-uri URI (a file: path, "
            "or a reachable MLflow server)"
        ) from None
    return client


def _refuse_missing_file_store(model_uri: str, uri: str) -> None:
    """Reading from a local store that is not there: MLflow would create an empty one at the (mistyped) path."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme in ("", "file") and not Path(parts.path).exists():
        raise UserInputError(
            f"{model_uri}: there is no MLflow store at {uri!r}; pass --tracking-uri with the file store that "
            "holds the model (e.g. <run>/mlruns) or a server URL"
        )


def fetch_registered(model_uri: str, tracking_uri: str | None, cache_dir: Path) -> Path:
    """The export directory of `models:/NAME/VERSION`, downloaded from the registry at `tracking_uri` (else
    `MLFLOW_TRACKING_URI`) into `cache_dir`, or one line saying what is wrong. A version's artifacts do not change,
    so a complete earlier download is reused; a download lands under a temporary name and is renamed into place."""
    match = _MODEL_URI.fullmatch(model_uri)
    if match is None:
        raise UserInputError(
            f"{model_uri!r}: a registered model is named models:/NAME/VERSION (VERSION a number, e.g. models:/tiny/1)"
        )
    name, version = match["name"], match["version"]
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise UserInputError(
            f"{model_uri}: pass --tracking-uri URI (or set MLFLOW_TRACKING_URI) to say which registry"
        )
    _refuse_missing_file_store(model_uri, uri)
    client = check_registry(name, uri, asked_by=model_uri)
    from mlflow.exceptions import MlflowException

    try:
        source = client.get_model_version_download_uri(name, version)
    except MlflowException:
        known = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
        raise UserInputError(
            f"{model_uri}: no such model version in {uri} (versions of {name!r}: "
            f"{', '.join(map(str, known)) or 'none'})"
        ) from None
    target = Path(cache_dir) / hashlib.sha256(uri.encode()).hexdigest()[:12] / name / version
    if target.is_dir():
        return target
    from mlflow.artifacts import download_artifacts

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{version}-") as tmp:
        local = Path(download_artifacts(artifact_uri=source, dst_path=tmp, tracking_uri=uri))
        try:
            local.rename(target)
        except OSError:
            if not target.is_dir():  # not another process that downloaded the same version first
                raise
    return target


def register_export(
    export_dir: Path,
    name: str,
    *,
    checkpoint: Path,
    metrics: dict[str, float],
    fmt: str,
    client: Any,
    tracking_uri: str,
    experiment: str = DEFAULT_EXPERIMENT,
) -> RegisteredVersion:
    """Log `export_dir` with the checkpoint's config and `metrics` (`checkpoint_metrics`, read before the export
    was written) as an MLflow run; register it as a new version."""
    ckpt = read_checkpoint(checkpoint, mmap=True)
    config = run_config(ckpt) or {}
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    run = client.create_run(
        experiment_id, run_name=f"{name}-export", tags=_tags(name, fmt, config, checkpoint)
    )
    run_id = run.info.run_id
    try:
        for key, value in _params(config).items():
            client.log_param(run_id, key, value)
        step = int(metrics.get("step", 0))
        for metric, number in metrics.items():
            client.log_metric(run_id, metric, number, step=step)
        client.log_artifacts(run_id, str(export_dir), "model")
        with tempfile.TemporaryDirectory() as tmp:
            config_path = Path(tmp) / "config.yaml"
            config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
            client.log_artifact(run_id, str(config_path))
        if not client.search_registered_models(filter_string=f"name = '{name}'"):
            client.create_registered_model(name, description="gaudi3-scale model exports")
        version = client.create_model_version(
            name,
            f"{run.info.artifact_uri}/model",
            run_id,
            tags={"format": fmt, "step": str(step), "checkpoint": str(Path(checkpoint).resolve())},
            description=f"{fmt} export of {checkpoint}",
        )
    except BaseException:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id)
    return RegisteredVersion(name, int(version.version), version.source, run_id, tracking_uri)


def checkpoint_metrics(checkpoint: Path) -> dict[str, float]:
    """step, tokens seen and validation loss from the manifest; train loss, val loss, tokens/s and MFU from the
    run's summary.json when the checkpoint is the run's last.

    Read before anything is exported or registered: a damaged summary.json is one line then, not after the
    export is written (when the same command, rerun, is refused for its non-empty --out). It is refused rather
    than passed over: a version registered without the metrics it should carry cannot be amended later."""
    directory = checkpoint_directory(Path(checkpoint))
    manifest = read_manifest(directory) if directory.is_dir() else None
    metrics: dict[str, float] = {}
    for key in ("step", "tokens_seen", "val_loss"):
        value = (manifest or {}).get(key)
        if isinstance(value, int | float) and value == value:
            metrics[key] = float(value)
    summary_path = directory.parent.parent / "summary.json"
    if summary_path.is_file():
        try:
            summary = load_json_file(summary_path, what="run summary")
        except UserInputError as exc:
            raise UserInputError(
                f"{exc}; --register logs its metrics: repair it, or move it away to register without them"
            ) from None
        if summary.get("steps") == metrics.get("step"):
            for key in ("train_loss", "val_loss", "tokens_per_s", "mfu"):
                value = summary.get(key)
                if isinstance(value, int | float) and value == value:
                    metrics[f"run_{key}" if key in metrics else key] = float(value)
    return metrics


def _params(config: dict[str, Any]) -> dict[str, str]:
    """The resolved config as `section.field` → text (MLflow params are strings of at most 6,000 characters)."""
    from gaudi3_scale.monitor.trackers import flatten_config

    return {key: str(value)[:6000] for key, value in flatten_config(config).items()}


def _tags(name: str, fmt: str, config: dict[str, Any], checkpoint: Path) -> dict[str, str]:
    model = config.get("model") or {}
    tags = {
        "gaudi3.format": fmt,
        "gaudi3.checkpoint": str(Path(checkpoint).resolve()),
        "gaudi3.registered": name,
    }
    for key in ("name", "arch"):
        if model.get(key):
            tags[f"gaudi3.model.{key}"] = str(model[key])
    if model:
        from gaudi3_scale.config.core import from_dict
        from gaudi3_scale.models import ModelConfig

        tags["gaudi3.model.parameters"] = str(count_parameters(from_dict(ModelConfig, model)))
    return tags
