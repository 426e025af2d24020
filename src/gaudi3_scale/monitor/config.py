"""The `monitor` section of a run config: the Prometheus endpoint and the experiment trackers."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.config.numbers import check_seconds
from gaudi3_scale.config.urls import check_http_url

__all__ = ["LOGGERS", "TRACKING_EXTRA", "MonitorConfig", "check_trackers", "installed"]

# Experiment trackers a run can write to, all at once if asked (metrics.jsonl is always written: it is what the
# summary, the dashboard and the benchmark results read).
LOGGERS = ("csv", "tensorboard", "mlflow", "wandb")
TRACKING_EXTRA = "pip install 'gaudi3-scale[tracking]'"


@dataclass(kw_only=True)
class MonitorConfig:
    metrics_port: int | None = field(
        default=None,
        metadata={
            "help": "serve Prometheus metrics at http://HOST:PORT/metrics; each rank on PORT + its local rank, "
            "labelled rank=…; 0 = a free port each; every rank writes its URL to <out>/metrics_endpoints/rank-<N>.json "
            "(and a Prometheus file_sd target to <out>/metrics_endpoints/file_sd/); null = off"
        },
    )
    metrics_host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "address the metrics endpoint binds to; 0.0.0.0 to let a Prometheus elsewhere scrape"
        },
    )
    system_every_s: float = field(
        default=5.0,
        metadata={"help": "how often host CPU/RAM and device (NVML / hl-smi) metrics are sampled, seconds"},
    )
    loggers: str = field(
        default="",
        metadata={
            "help": "experiment trackers besides metrics.jsonl, comma-separated: csv, tensorboard, mlflow, wandb "
            "(hyperparameters and the resolved config are logged to each)"
        },
    )
    mlflow_tracking_uri: str | None = field(
        default=None,
        metadata={"help": "MLflow tracking URI; null = a local file store in <out>/mlruns"},
    )
    experiment: str | None = field(
        default=None, metadata={"help": "experiment name for MLflow / W&B project; null = the run name"}
    )

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port", f"must be 0..65535 or null, got {self.metrics_port}")
        if not self.metrics_host:
            raise ConfigError("metrics_host", "must be an address such as 127.0.0.1 or 0.0.0.0")
        check_seconds("system_every_s", self.system_every_s)
        uri = self.mlflow_tracking_uri
        if uri is not None and uri.partition(":")[0].lower() in ("http", "https"):
            # A host is needed: MLflow would read `http://` as a request to the host "api", after its retries.
            check_http_url("mlflow_tracking_uri", uri)
        unknown = [name for name in self.logger_names if name not in LOGGERS]
        if unknown:
            raise ConfigError(
                "loggers",
                f"unknown logger(s) {', '.join(unknown)}; allowed: {', '.join(LOGGERS)} (comma-separated)",
            )

    @property
    def logger_names(self) -> list[str]:
        return list(dict.fromkeys(n.strip().lower() for n in self.loggers.split(",") if n.strip()))


def check_trackers(monitor: MonitorConfig) -> None:
    """Each configured tracker's package is installed (and W&B configured), or one line on `monitor.loggers`."""
    for name in monitor.logger_names:
        if name == "tensorboard" and not (installed("tensorboard") or installed("tensorboardX")):
            raise ConfigError("monitor.loggers", f"tensorboard is not installed: {TRACKING_EXTRA}")
        if name == "mlflow" and not installed("mlflow"):
            raise ConfigError("monitor.loggers", f"mlflow is not installed: {TRACKING_EXTRA}")
        if name == "wandb":
            if not installed("wandb"):
                raise ConfigError("monitor.loggers", "wandb is not installed: pip install wandb")
            mode = os.environ.get("WANDB_MODE", "").lower()
            if not os.environ.get("WANDB_API_KEY") and mode not in ("offline", "disabled", "dryrun"):
                raise ConfigError(
                    "monitor.loggers",
                    "wandb is not configured: set WANDB_API_KEY, or WANDB_MODE=offline to write <out>/wandb/ "
                    "and `wandb sync` it later",
                )


def installed(module: str) -> bool:
    """`module` can be imported here (found, not imported)."""
    return importlib.util.find_spec(module) is not None
