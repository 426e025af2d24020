"""What runs beside a fit, on threads of its own, and stops with it: this rank's Prometheus endpoint
(`monitor.metrics_port`), the node's spot-interruption watcher (`train.spot_watch`) and this rank's hang watchdog
(`health.watchdog`). They start from the run's parts (`train.parts`): the endpoint listens to the metrics records, a
spot notice is a graceful stop, the watchdog (built with the parts) follows the step and the checkpoint saves.

`start_services` returns them as one `ExitStack`: the fit runs inside it, and leaving it (also by an exception)
stops every service and closes the run's background work, the checkpointer's uploads last.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gaudi3_scale.distributed.env import launched_local_rank
from gaudi3_scale.monitor.config import MonitorConfig
from gaudi3_scale.train.after_step import AfterStep
from gaudi3_scale.train.callbacks import GracefulInterrupt
from gaudi3_scale.train.spot import SpotInterruptionWatcher
from gaudi3_scale.train.train_config import TrainConfig

if TYPE_CHECKING:
    import torch

    from gaudi3_scale.health.watchdog import Watchdog
    from gaudi3_scale.monitor.prometheus import MetricsEndpoint

__all__ = ["start_services"]


def start_services(
    after: AfterStep,
    *,
    monitor: MonitorConfig,
    train: TrainConfig,
    run_name: str,
    out_dir: Path,
    device: torch.device,
    accelerator: str,
    warn: Callable[[str], None],
    predicted: dict[str, Any] | None = None,
) -> ExitStack:
    """Start what runs beside the fit (`with start_services(…):` around it). Leaving the stack stops them in the
    reverse order: the watchdog first, the price poller of the spot policy next to last, then the checkpointer, which
    drains its uploads and applies the retention that waited on them. A service that fails to start stops those
    started before it."""
    with ExitStack() as running:
        running.callback(after.checkpoint.checkpointer.close)
        if after.cost is not None and after.cost.spot is not None:
            running.callback(after.cost.spot.prices.close)
        endpoint = _start_metrics_endpoint(after, monitor, run_name=run_name, out_dir=out_dir, device=device,
                                           warn=warn)  # fmt: skip
        if endpoint is not None:
            running.callback(endpoint.stop)
            if predicted:  # the run's forecast (train.forecast_file): gauges beside the measured ones
                endpoint.observe(predicted)
        watcher = _start_spot_watcher(train, after.stop)
        if watcher is not None:
            running.callback(watcher.stop)
        watchdog = _start_watchdog(after.watchdog, accelerator=accelerator)
        if watchdog is not None:
            running.callback(watchdog.stop)
        return running.pop_all()


def _start_metrics_endpoint(
    after: AfterStep,
    cfg: MonitorConfig,
    *,
    run_name: str,
    out_dir: Path,
    device: torch.device,
    warn: Callable[[str], None],
) -> MetricsEndpoint | None:
    """This rank's Prometheus endpoint (`monitor.metrics_port`); a busy port is one line before training."""
    if cfg.metrics_port is None:
        return None
    from gaudi3_scale.monitor.prometheus import start_exporter

    metrics = after.metrics
    endpoint = start_exporter(cfg, run=run_name, out_dir=out_dir, device=device,
                              tokens_per_step=metrics.tokens_per_step, warn=warn)  # fmt: skip
    metrics.listeners.append(endpoint.observe)
    endpoint.exporter.track_checkpoint_saves(after.checkpoint.blocking_s)
    return endpoint


def _start_spot_watcher(cfg: TrainConfig, interrupt: GracefulInterrupt) -> SpotInterruptionWatcher | None:
    """One watcher per node (local rank 0): a notice there stops every rank through GracefulInterrupt."""
    if not cfg.spot_watch or launched_local_rank() != 0:
        return None
    return SpotInterruptionWatcher(
        cfg.spot_url,
        lambda text: interrupt.request(f"spot interruption notice ({text})"),
        poll_s=cfg.spot_poll_s,
    ).start()


def _start_watchdog(watchdog: Watchdog | None, *, accelerator: str) -> Watchdog | None:
    """Start watching (setup first); on CUDA the NCCL flight recorder is enabled before the process group exists,
    dumping into the same directory (a user's own TORCH_NCCL_* settings win)."""
    if watchdog is None:
        return None
    if accelerator == "cuda":
        from gaudi3_scale.health.dumps import flight_recorder_env

        for name, value in flight_recorder_env(watchdog.health_dir).items():
            os.environ.setdefault(name, value)
    return watchdog.start()
