"""Experiment trackers (`monitor.loggers`): Lightning's CSV, TensorBoard, MLflow and W&B loggers, fed our records.

Our metrics are computed in `RunMetrics` (metrics.jsonl), not through `LightningModule.log`, so every numeric field
of every record is forwarded to each logger under a namespaced name (`train/loss`, `perf/mfu`, `cost/usd` …, see
`METRIC_NAMES`). The module's own `self.log` values (`val/loss`) reach the loggers through Lightning as usual; the
hyperparameters (the resolved config, flattened to `section.field`) are logged once per fit, and the resolved
config.yaml goes to MLflow as an artifact and to TensorBoard as text.

Where the files go, under the run directory:

    tensorboard/            event files; one directory for the whole run, resumed sessions append
    csv/version_N/          metrics.csv + hparams.yaml; one version per session (Lightning's CSV writer would
                            delete an existing metrics.csv otherwise)
    mlruns/                 the MLflow file store (monitor.mlflow_tracking_uri null); one MLflow run per session
    wandb/                  W&B's local files

The loggers are built on global rank 0 only: they log from rank 0 anyway (`rank_zero_only`), and MLflow's file store
is not safe against several processes creating it at once. The packages are checked on every rank, so a missing
one stops every rank with the same line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

import lightning.pytorch as pl
import yaml
from lightning.pytorch.loggers import Logger

from gaudi3_scale.config.core import to_dict
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.distributed.env import launched_rank
from gaudi3_scale.monitor.config import MonitorConfig, check_trackers, installed

__all__ = [
    "METRIC_NAMES",
    "ExperimentTrackers",
    "SafeTracker",
    "build_trackers",
    "flatten_config",
    "mlflow_client",
    "prepare_mlflow_environment",
    "tracker_metrics",
    "warn_on_stderr",
]

# MLflow's HTTP client retries a failed call 7 times with exponential backoff (~4 minutes) and waits 120 s for an
# answer (mlflow.environment_variables: MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT). Every tracker
# call is made from the training loop, so a tracking server that is down would stall training that long per call,
# and an unreachable URI would keep `gaudi3 train` silent for ~4 minutes before its one line. Ours, unless the user
# set them: ~5 s for a refused connection, at most ~35 s for a server that never answers.
MLFLOW_HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


# Record field (metrics.jsonl) → tracker metric name. Fields that already hold a "/" keep their name
# (`checkpoint/remote_backlog`); others not listed here are forwarded under their own name.
METRIC_NAMES: dict[str, str] = {
    "train_loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "val_loss": "val/loss",
    "val_mlm_accuracy": "val/mlm_accuracy",
    "tokens_per_s": "perf/tokens_per_s",
    "samples_per_s": "perf/samples_per_s",
    "step_time_s": "perf/step_time_s",
    "data_wait_s": "perf/data_wait_s",
    "window_steps": "perf/window_steps",
    "mfu": "perf/mfu",
    "peak_memory_bytes": "perf/peak_memory_bytes",
    "peak_memory_bytes_per_rank": "perf/peak_memory_bytes_per_rank",  # a list: one series per rank, …/0, …/1
    "compute_s_per_rank": "perf/compute_s_per_rank",
    "wall_s": "perf/wall_s",  # since the trainer's start, at the window's end
    "cost_usd": "cost/usd",
    "cost_usd_per_hour": "cost/usd_per_hour",
    "cost_projected_usd": "cost/projected_usd",
    "cost_budget_usd": "cost/budget_usd",
    "cost_budget_remaining_usd": "cost/budget_remaining_usd",
    "cost_budget_warning": "cost/budget_warning",
    "projected_finish_unix": "cost/projected_finish_unix",
    "spot_price_usd_per_hour": "metering/spot_price_usd_per_hour",
    "spot_decision": "metering/spot_decision",
}

# Logged by the LightningModule itself (`self.log("val/loss")`), which Lightning passes on to the loggers: not
# forwarded a second time.
_LOGGED_BY_MODULE = frozenset({"val_loss", "val_mlm_accuracy"})
# Not a measurement: `stragglers` lists rank numbers (Prometheus has gaudi3_straggler per rank); `time_unix` dates
# the record (trackers date their points themselves).
_NOT_METRICS = frozenset({"stragglers", "time_unix"})


def warn_on_stderr(message: str) -> None:
    """A `warning:` line on stderr (where the trainer's console writes its own)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


class _Listeners(Protocol):
    """What `build_trackers` needs of RunMetrics (monitor does not import train)."""

    listeners: list[Callable[[dict[str, Any]], None]]


def tracker_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record → {tracker name: value}: numbers and booleans only; `step` is the x axis, not a metric."""
    metrics: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or key in _LOGGED_BY_MODULE or key in _NOT_METRICS:
            continue
        name = METRIC_NAMES.get(key, key)
        if isinstance(value, list | tuple):
            for i, item in enumerate(value):
                if _is_number(item):
                    metrics[f"{name}/{i}"] = float(item)
        elif _is_number(value):
            metrics[name] = float(value)
    return metrics


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, int | float) and value == value
    )  # bool is an int; NaN is dropped (value != value)


def flatten_config(config: Any) -> dict[str, Any]:
    """The resolved config (a config dataclass or its `to_dict` form) as `section.field` → value (scalars; lists
    stay lists), for `log_hyperparams`."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            flat[prefix] = node

    walk("", config if isinstance(config, Mapping) else to_dict(config))
    return flat


class SafeTracker(Logger):
    """A Lightning logger whose failure never stops training: every call to it (ours and Lightning's: metrics,
    hyperparameters, `save`, `finalize`, the lazy `experiment`) goes through `call`. The first exception is one
    warning line naming the tracker and the error, and the tracker is off for the rest of the run: no further call
    reaches it, `finalize` included (a server that is down would fail that too, after its retries).
    metrics.jsonl does not depend on it."""

    def __init__(self, name: str, tracker: Logger, warn: Callable[[str], None]) -> None:
        super().__init__()
        self.name_in_config = name  # as monitor.loggers names it
        self.tracker = tracker
        self.warn = warn
        self.failed = False

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, or None once the tracker has failed (`what`: the call, for the warning)."""
        if self.failed:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # any failure of a tracker (network, disk, its own bugs): training goes on
            self.failed = True
            detail = (str(exc).strip().splitlines() or [""])[0]
            self.warn(
                f"monitor.loggers: {self.name_in_config} failed ({what}: {type(exc).__name__}: {detail}); it is "
                "off for the rest of the run, training goes on (metrics.jsonl has every record)"
            )
            return None

    @property
    def name(self) -> str | None:
        return self.call("name", lambda: self.tracker.name)

    @property
    def version(self) -> int | str | None:
        return self.call("version", lambda: self.tracker.version)

    @property
    def root_dir(self) -> str | None:
        return self.tracker.root_dir

    @property
    def log_dir(self) -> str | None:
        return self.tracker.log_dir

    @property
    def save_dir(self) -> str | None:
        return self.tracker.save_dir

    @property
    def experiment(self) -> Any:
        return self.call("start", lambda: getattr(self.tracker, "experiment", None))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.call("log metrics", self.tracker.log_metrics, metrics, step=step)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.call("log hyperparameters", self.tracker.log_hyperparams, params, *args, **kwargs)

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        self.call("log graph", self.tracker.log_graph, model, input_array)

    def save(self) -> None:
        self.call("save", self.tracker.save)

    def finalize(self, status: str) -> None:
        self.call("finalize", self.tracker.finalize, status)

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self.call("log checkpoint", self.tracker.after_save_checkpoint, checkpoint_callback)


class ExperimentTrackers(pl.Callback):
    """Feeds the loggers our records, the flat resolved config and config.yaml; fixes the step Lightning logs at.

    Lightning logs `self.log` values at its count of batches, which under our manual gradient accumulation is the
    count of micro-batches; a `step` metric, when logged, is used instead (Lightning's `log_metrics` docstring), so
    validation values land on the optimizer step that metrics.jsonl records them at.
    """

    def __init__(self, loggers: list[SafeTracker], hyperparameters: Mapping[str, Any]) -> None:
        self.loggers = loggers  # empty on ranks other than 0
        self.hyperparameters = hyperparameters  # the resolved run config, as config.yaml holds it

    def forward(self, record: dict[str, Any]) -> None:
        """A RunMetrics listener: one record → every logger, at the record's optimizer step."""
        metrics = tracker_metrics(record)
        if not metrics:
            return
        for logger in self.loggers:
            logger.log_metrics(metrics, step=record["step"])
            logger.save()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.loggers:
            return
        params = flatten_config(self.hyperparameters)
        config_yaml = yaml.safe_dump(dict(self.hyperparameters), sort_keys=False)  # the text of config.yaml
        for logger in self.loggers:
            logger.log_hyperparams(params)
            logger.call("log config.yaml", _log_config_file, logger.tracker, config_yaml)
            logger.save()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            # Every rank logs it (the ranks agree on the value; sync_dist keeps Lightning from warning).
            pl_module.log("step", float(trainer.global_step), sync_dist=True)


def _log_config_file(logger: Logger, config_yaml: str) -> None:
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger

    if isinstance(logger, MLFlowLogger):
        assert logger.run_id is not None
        logger.experiment.log_text(logger.run_id, config_yaml, "config.yaml")
    elif isinstance(logger, TensorBoardLogger):
        # Markdown: indented lines are a code block, so the YAML keeps its layout.
        logger.experiment.add_text(
            "config.yaml", "\n".join("    " + line for line in config_yaml.splitlines())
        )
    # CSV: hparams.yaml next to metrics.csv holds the same; W&B: its run config holds the hyperparameters.


def build_trackers(
    monitor: MonitorConfig,
    *,
    run_name: str,
    hyperparameters: Mapping[str, Any],
    out_dir: Path,
    metrics: _Listeners,
    warn: Callable[[str], None] = warn_on_stderr,
) -> ExperimentTrackers | None:
    """The loggers `monitor.loggers` names, as a callback subscribed to `metrics`; None when none are named.

    `run_name` names the run (and the experiment, unless `monitor.experiment` does); `hyperparameters` is the
    resolved run config as a dict (`config.core.to_dict`), logged whole. Each logger is a `SafeTracker`: one that
    fails mid-run is `warn`ed about once (default: a `warning:` line on stderr) and switched off.
    """
    names = monitor.logger_names
    if not names:
        return None
    check_trackers(monitor)
    loggers: list[SafeTracker] = []
    if launched_rank() == 0:
        loggers = [SafeTracker(name, _BUILDERS[name](monitor, run_name, out_dir), warn) for name in names]
    trackers = ExperimentTrackers(loggers, hyperparameters)
    if loggers:
        metrics.listeners.append(trackers.forward)
    return trackers


def _csv(monitor: MonitorConfig, run_name: str, out_dir: Path) -> Logger:
    from lightning.pytorch.loggers import CSVLogger

    return CSVLogger(out_dir, name="csv")


def _tensorboard(monitor: MonitorConfig, run_name: str, out_dir: Path) -> Logger:
    from lightning.pytorch.loggers import TensorBoardLogger

    # default_hp_metric off: no placeholder `hp_metric` = -1 series.
    return TensorBoardLogger(out_dir, name="tensorboard", version="", default_hp_metric=False)


def mlflow_tracking_uri(monitor: MonitorConfig, out_dir: Path) -> str:
    """`monitor.mlflow_tracking_uri`, or the run's local file store `<out>/mlruns`."""
    return monitor.mlflow_tracking_uri or (out_dir / "mlruns").resolve().as_uri()


def mlflow_client(uri: str) -> Any:
    """An `MlflowClient` for tracking and model registry at `uri`, with our environment set before the import."""
    prepare_mlflow_environment(uri)
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri, registry_uri=uri)


def prepare_mlflow_environment(uri: str) -> None:
    # Before mlflow is imported: it starts its usage telemetry at import unless this is set (documented in
    # mlflow.environment_variables); nothing is sent anywhere it was not asked to.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    for name, value in MLFLOW_HTTP_BOUNDS.items():
        os.environ.setdefault(name, value)
    if urlparse(uri).scheme in ("", "file"):
        # MLflow 3 refuses the file store (maintenance mode) unless this is set; mlflow-skinny has no SQLAlchemy
        # for its sqlite:// alternative, so the file store is the one local store that works with the extra.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


def _mlflow(monitor: MonitorConfig, run_name: str, out_dir: Path) -> Logger:
    uri = mlflow_tracking_uri(monitor, out_dir)
    from lightning.pytorch.loggers import MLFlowLogger

    experiment = monitor.experiment or run_name
    prepare_mlflow_environment(uri)
    from mlflow.exceptions import MlflowException

    try:
        client = mlflow_client(uri)
        # Created here, so Lightning does not warn "Experiment with name … not found. Creating it."
        if client.get_experiment_by_name(experiment) is None:
            client.create_experiment(experiment)
    except OSError as exc:  # the file store: a path that cannot be created (a file in the way, no permission)
        where = exc.filename or uri
        raise ConfigError(
            "monitor.mlflow_tracking_uri",
            f"cannot create the MLflow file store at {where}: {exc.strerror or exc}",
        ) from None
    except MlflowException as exc:
        hint = ""
        if urlparse(uri).scheme.startswith("sqlite") and not installed("sqlalchemy"):
            hint = " (sqlite:// needs SQLAlchemy: pip install mlflow, or use a file: URI)"
        raise ConfigError(
            "monitor.mlflow_tracking_uri", f"MLflow cannot use {uri!r}: {str(exc).splitlines()[0]}{hint}"
        ) from None
    return MLFlowLogger(experiment_name=experiment, run_name=run_name, tracking_uri=uri)


def _wandb(monitor: MonitorConfig, run_name: str, out_dir: Path) -> Logger:
    from lightning.pytorch.loggers import WandbLogger

    return WandbLogger(name=run_name, project=monitor.experiment or run_name, save_dir=str(out_dir))


_BUILDERS: dict[str, Callable[[MonitorConfig, str, Path], Logger]] = {
    "csv": _csv,
    "tensorboard": _tensorboard,
    "mlflow": _mlflow,
    "wandb": _wandb,
}
