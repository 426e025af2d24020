"""A Prometheus `/metrics` endpoint per rank (`monitor.metrics_port`), served from a background thread.

Every rank serves its own endpoint on `metrics_port + LOCAL_RANK` (0: a free port each) at `monitor.metrics_host`,
and every series carries the labels `rank` (global rank) and `run` (run name). So that a scraper can find them,
each rank writes while its endpoint is up:

    <out>/metrics_endpoints/rank-<N>.json          {"rank": N, "url": "http://…/metrics", "pid": …, …}
    <out>/metrics_endpoints/file_sd/rank-<N>.json  the same target in Prometheus file_sd format

and removes both when it stops (a file whose pid is gone is left by a crash). Per-rank files need no coordination
between ranks; the shipped `assets/prometheus.yml` globs `file_sd/*.json`.

A counter counts from its process's start, as Prometheus expects (it takes a drop for a process restart). A fit
after a rollback (`train.rollback`) starts a new endpoint in the same process; it serves the rank's exporter of the
fit before, so its counters carry on (`gaudi3_health_rollbacks_total` 0, 1, 2 … across the re-fits).

Values come from three places: `RunMetrics` records (`observe`, every `train.log_every_steps` steps on every
rank), `StepCheckpoint.blocking_s` (`track_checkpoint_saves`, read again on every scrape), and the
`SystemSampler` thread. Names follow the Prometheus conventions (base units, `_total` for counters); `METRICS`
below is the one list of them, and docs/metrics.md documents each. `ASSETS_DIR` holds the shipped Prometheus
config, alerting rules (with their promtool tests) and Grafana dashboard.

prometheus-client is the optional extra `monitor`, imported only when an endpoint is asked for.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from gaudi3_scale.config.atomic import write_text_atomic
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.distributed.env import launched_local_rank, launched_rank
from gaudi3_scale.monitor.config import MonitorConfig
from gaudi3_scale.monitor.durations import Durations
from gaudi3_scale.monitor.system import DeviceSample, SystemSample, SystemSampler

__all__ = [
    "ASSETS_DIR",
    "ENDPOINTS_DIR",
    "METRICS",
    "Metric",
    "MetricsEndpoint",
    "MetricsExporter",
    "read_endpoints",
    "start_exporter",
]

ENDPOINTS_DIR = "metrics_endpoints"
ASSETS_DIR = Path(__file__).parent / "assets"  # prometheus.yml, alerts.yml, alerts_test.yml, grafana/*.json
LABELS = ("rank", "run")
# This process's exporters by (run directory, run, rank): a re-fit's endpoint serves the one of the fit before.
_EXPORTERS: dict[tuple[Path, str, int], MetricsExporter] = {}


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Literal["gauge", "counter"]
    help: str
    record_key: str | None = None  # the RunMetrics record field it shows, if any
    per_device: bool = False  # one series per accelerator of the node (label `device`)


_NODE = "node-wide, from local rank 0; label device = the index NVML / hl-smi reports"

# The one list of exported names (docs/metrics.md documents each; a test keeps the two in step).
# fmt: off
METRICS: tuple[Metric, ...] = (
    # RunMetrics records: run-wide values as each rank measured them (aggregate with max or avg, never sum).
    Metric("gaudi3_train_loss", "gauge", "mean training loss since the previous record", "train_loss"),
    Metric("gaudi3_val_loss", "gauge", "latest validation loss", "val_loss"),
    Metric("gaudi3_learning_rate", "gauge", "learning rate", "lr"),
    Metric("gaudi3_grad_norm", "gauge", "global gradient L2 norm before clipping", "grad_norm"),
    Metric("gaudi3_tokens_per_second", "gauge", "training throughput of the run, tokens/s", "tokens_per_s"),
    Metric("gaudi3_samples_per_second", "gauge", "training throughput of the run, sequences/s", "samples_per_s"),
    Metric("gaudi3_mfu_ratio", "gauge", "model FLOPs utilization (PaLM, Appendix B), 0..1", "mfu"),
    Metric("gaudi3_step_duration_seconds", "gauge", "mean optimizer step time on this rank", "step_time_s"),
    Metric("gaudi3_data_wait_seconds", "gauge", "mean time per step this rank waited for data", "data_wait_s"),
    Metric("gaudi3_train_step", "gauge", "global optimizer step (restored on resume)", "step"),
    Metric("gaudi3_steps_total", "counter", "optimizer steps this process ran"),
    Metric("gaudi3_tokens_total", "counter", "tokens the run trained on while this process ran"),
    Metric("gaudi3_last_step_timestamp_seconds", "gauge", "Unix time of the latest step record"),
    # The run's forecast (gaudi3 plan, recorded by gaudi3 train at its start): beside the measured gauges above.
    Metric("gaudi3_predicted_step_duration_seconds", "gauge", "forecast optimizer step time", "predicted_step_time_s"),
    Metric("gaudi3_predicted_wall_seconds", "gauge", "forecast wall time of train.max_steps", "predicted_wall_s"),
    Metric("gaudi3_predicted_peak_memory_bytes", "gauge", "forecast per-rank peak memory",
           "predicted_peak_memory_bytes"),
    # Live cost (cost.*): gauges, not counters, because the accrued cost is restored from checkpoints.
    Metric("gaudi3_cost_usd", "gauge", "cost accrued by the run, USD", "cost_usd"),
    Metric("gaudi3_cost_projected_usd", "gauge", "projected cost at train.max_steps, USD", "cost_projected_usd"),
    Metric("gaudi3_cost_budget_usd", "gauge", "cost.budget_usd, USD", "cost_budget_usd"),
    Metric("gaudi3_cost_budget_remaining_usd", "gauge", "budget left, USD", "cost_budget_remaining_usd"),
    Metric("gaudi3_cost_usd_per_hour", "gauge", "price of the run's nodes, USD/h", "cost_usd_per_hour"),
    # Remote checkpoint mirror (checkpoint.remote_url; rank 0 uploads).
    Metric("gaudi3_checkpoint_upload_backlog", "gauge", "checkpoints not yet verified remotely",
           "checkpoint/remote_backlog"),
    Metric("gaudi3_checkpoint_upload_outage", "gauge", "1 while uploads fail, 0 once one succeeds",
           "checkpoint/remote_outage"),
    Metric("gaudi3_checkpoint_upload_consecutive_failures", "gauge", "failed upload attempts in a row",
           "checkpoint/remote_consecutive_failures"),
    Metric("gaudi3_checkpoint_uploaded_bytes", "gauge", "bytes uploaded since the run started, retries included",
           "checkpoint/remote_uploaded_bytes"),
    # StepCheckpoint.blocking_s.
    Metric("gaudi3_checkpoint_save_seconds", "gauge", "how long the latest checkpoint save stopped training"),
    Metric("gaudi3_checkpoint_saves_total", "counter", "checkpoint saves this process made, full and light"),
    # Training health (health.*): events of this process, from RunMetrics' health_event records.
    Metric("gaudi3_health_nonfinite_steps_total", "counter", "steps whose loss or gradient norm was NaN/Inf"),
    Metric("gaudi3_health_loss_spikes_total", "counter", "loss spikes over the running median + k × MAD"),
    Metric("gaudi3_health_grad_norm_spikes_total", "counter", "gradient-norm spikes over the running median + k × MAD"),
    Metric("gaudi3_health_dropped_updates_total", "counter", "optimizer updates dropped by the health guard"),
    # Straggler detection (health.stragglers): this rank's entries of the window's per-rank lists.
    Metric("gaudi3_rank_compute_seconds", "gauge", "this rank's own compute (forward) per step in the window"),
    Metric("gaudi3_straggler", "gauge", "1 while this rank is named a straggler, else 0"),
    Metric("gaudi3_health_rollbacks_total", "counter", "rollbacks to a checkpoint before a loss spike"),
    # SystemSampler.
    Metric("gaudi3_device_memory_allocated_bytes", "gauge", "accelerator memory allocated (CPU: process RSS)"),
    Metric("gaudi3_device_memory_peak_bytes", "gauge", "peak accelerator memory allocated (CPU: peak RSS)"),
    Metric("gaudi3_process_resident_memory_bytes", "gauge", "resident set size of this rank's process"),
    Metric("gaudi3_host_cpu_utilization_ratio", "gauge", "host CPU utilization, 0..1 (local rank 0)"),
    Metric("gaudi3_host_memory_used_bytes", "gauge", "host RAM in use, total - available (local rank 0)"),
    Metric("gaudi3_host_memory_total_bytes", "gauge", "host RAM (local rank 0)"),
    Metric("gaudi3_gpu_utilization_ratio", "gauge", f"GPU utilization, 0..1; {_NODE}", per_device=True),
    Metric("gaudi3_gpu_memory_used_bytes", "gauge", f"GPU memory used; {_NODE}", per_device=True),
    Metric("gaudi3_gpu_memory_total_bytes", "gauge", f"GPU memory; {_NODE}", per_device=True),
    Metric("gaudi3_gpu_power_watts", "gauge", f"GPU power draw; {_NODE}", per_device=True),
    Metric("gaudi3_gpu_temperature_celsius", "gauge", f"GPU die temperature, degrees Celsius; {_NODE}",
           per_device=True),
    Metric("gaudi3_hpu_utilization_ratio", "gauge", f"Gaudi utilization, 0..1; {_NODE}", per_device=True),
    Metric("gaudi3_hpu_memory_used_bytes", "gauge", f"Gaudi memory used; {_NODE}", per_device=True),
    Metric("gaudi3_hpu_memory_total_bytes", "gauge", f"Gaudi memory; {_NODE}", per_device=True),
    Metric("gaudi3_hpu_power_watts", "gauge", f"Gaudi power draw; {_NODE}", per_device=True),
    Metric("gaudi3_hpu_temperature_celsius", "gauge", f"Gaudi temperature, degrees Celsius; {_NODE}",
           per_device=True),
)
# fmt: on

_HEALTH_COUNTERS = {
    "nonfinite": "gaudi3_health_nonfinite_steps_total",
    "loss_spike": "gaudi3_health_loss_spikes_total",
    "grad_norm_spike": "gaudi3_health_grad_norm_spikes_total",
    "rollback": "gaudi3_health_rollbacks_total",
}

_DEVICE_FIELDS = (
    "utilization_ratio",
    "memory_used_bytes",
    "memory_total_bytes",
    "power_watts",
    "temperature_celsius",
)
_SYSTEM_FIELDS = (
    "device_memory_allocated_bytes",
    "device_memory_peak_bytes",
    "process_resident_memory_bytes",
    "host_cpu_utilization_ratio",
    "host_memory_used_bytes",
    "host_memory_total_bytes",
)


def _import_client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise UserInputError(
            "monitor.metrics_port is set but prometheus-client is not installed: "
            "pip install 'gaudi3-scale[monitor]' (or set monitor.metrics_port to null)"
        ) from None
    return prometheus_client


class _BeforeScrape:
    """A collector that exports nothing: registered first, it brings pulled values up to date on every scrape."""

    def __init__(self, update: Callable[[], None]) -> None:
        self.update = update

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        self.update()
        return []


class MetricsExporter:
    """The series of one rank in a dedicated `CollectorRegistry`; `observe` is a `RunMetrics` listener.

    A series appears with its first value: a metric that is unknown here (no cost tracking, no GPU) is absent,
    never 0.
    """

    def __init__(self, registry: Any, *, rank: int, run: str, tokens_per_step: int) -> None:
        client = _import_client()
        self.registry = registry
        self.rank = rank
        self.labels = {"rank": str(rank), "run": run}
        self.tokens_per_step = tokens_per_step
        self._by_record_key = {m.record_key: m.name for m in METRICS if m.record_key is not None}
        self._saves: Durations | None = None
        self._saves_seen = 0
        self._lock = threading.Lock()  # the training thread and scrapes both sync saves
        # Saves happen between records: each scrape picks up the new ones first (collected in registration order).
        registry.register(_BeforeScrape(self.sync_checkpoint_saves))
        self._families: dict[str, Any] = {}
        for metric in METRICS:
            cls = client.Gauge if metric.kind == "gauge" else client.Counter  # Counter adds `_total` itself
            labelnames = (*LABELS, "device") if metric.per_device else LABELS
            self._families[metric.name] = cls(metric.name, metric.help, labelnames, registry=registry)
        for name in (*_HEALTH_COUNTERS.values(), "gaudi3_health_dropped_updates_total"):
            self._series(name)  # at 0 from the start: "no event yet" is a value (and rate() needs the zero)

    def _series(self, name: str, **extra: str) -> Any:
        return self._families[name].labels(**self.labels, **extra)

    def set(self, name: str, value: float, **extra: str) -> None:
        self._series(name, **extra).set(value)

    def observe(self, record: dict[str, Any]) -> None:
        """A RunMetrics record (train or validation); None fields are left as they were."""
        for key, value in record.items():
            name = self._by_record_key.get(key)
            if name is not None and isinstance(value, int | float):  # bools too (the outage flag)
                self.set(name, float(value))
        event = record.get("health_event")
        if event in _HEALTH_COUNTERS:
            self._series(_HEALTH_COUNTERS[event]).inc()
            if record.get("health_action") == "skip":
                self._series("gaudi3_health_dropped_updates_total").inc()
        compute = record.get("compute_s_per_rank")
        if isinstance(compute, list) and self.rank < len(compute):
            self.set("gaudi3_rank_compute_seconds", float(compute[self.rank]))
            self.set("gaudi3_straggler", float(self.rank in record.get("stragglers", ())))
        window_steps = record.get("window_steps")
        if window_steps:
            self._series("gaudi3_steps_total").inc(window_steps)
            self._series("gaudi3_tokens_total").inc(window_steps * self.tokens_per_step)
            self.set("gaudi3_last_step_timestamp_seconds", time.time())

    def track_checkpoint_saves(self, blocking_s: Durations) -> None:
        """Follow the durations of the run's saves, one more per save (`StepCheckpoint.blocking_s`)."""
        self._saves, self._saves_seen = blocking_s, 0
        self.sync_checkpoint_saves()

    def sync_checkpoint_saves(self) -> None:
        if self._saves is None:
            return
        count, last_s = self._saves.snapshot()
        with self._lock:  # two scrapes at once: the one with the older snapshot counts nothing, never again
            new = count - self._saves_seen
            self._saves_seen = max(self._saves_seen, count)
        if new > 0 and last_s is not None:
            self._series("gaudi3_checkpoint_saves_total").inc(new)
            self.set("gaudi3_checkpoint_save_seconds", last_s)

    def publish_system(self, sample: SystemSample) -> None:
        """A `SystemSampler` reading."""
        for name in _SYSTEM_FIELDS:
            value = getattr(sample, name)
            if value is not None:
                self.set(f"gaudi3_{name}", float(value))
        self._publish_devices("gpu", sample.gpus)
        self._publish_devices("hpu", sample.hpus)

    def _publish_devices(self, kind: str, devices: list[DeviceSample]) -> None:
        for device in devices:
            for attr in _DEVICE_FIELDS:
                value = getattr(device, attr)
                if value is not None and math.isfinite(value):
                    self.set(f"gaudi3_{kind}_{attr}", float(value), device=str(device.index))


class MetricsEndpoint:
    """A rank's exporter with its HTTP server, sampler thread and endpoint files; `stop()` takes them down."""

    def __init__(self, exporter: MetricsExporter, server: Any, thread: threading.Thread, url: str) -> None:
        self.exporter = exporter
        self.url = url
        self.port = int(server.server_port)
        self.files: list[Path] = []
        self.sampler: SystemSampler | None = None
        self._server = server
        self._thread = thread

    def observe(self, record: dict[str, Any]) -> None:
        self.exporter.observe(record)

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        for path in self.files:
            path.unlink(missing_ok=True)


def _display_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()  # what another machine would dial
    return f"[{host}]" if ":" in host else host


def _write_json(path: Path, payload: Any) -> None:
    """Atomically: a reader (Prometheus, the dashboard) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


def _link_local(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a host name
        return False
    return address.version == 6 and address.is_link_local and "%" not in host


def _serve(client: Any, registry: Any, host: str, port: int, local_rank: int) -> tuple[Any, threading.Thread]:
    try:
        return client.start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(
                "monitor.metrics_host", f"cannot bind to {host!r}: not an address of this machine"
            ) from None
        if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
            # EINVAL, EAFNOSUPPORT …: the address cannot be bound here. An IPv6 link-local one needs its zone.
            hint = f" (a link-local IPv6 address needs a zone, e.g. {host}%eth0)" if _link_local(host) else ""
            raise ConfigError(
                "monitor.metrics_host", f"cannot bind to {host!r}: {exc.strerror or exc}{hint}"
            ) from None
        what = "already in use" if exc.errno == errno.EADDRINUSE else "not allowed for this user"
        raise ConfigError(
            "monitor.metrics_port",
            f"port {port} on {host} is {what} (this rank serves metrics_port + local rank {local_rank}); "
            "choose another port, or 0 for a free port per rank",
        ) from None


def start_exporter(
    cfg: MonitorConfig,
    *,
    run: str,
    out_dir: Path,
    device: torch.device,
    tokens_per_step: int,
    warn: Callable[[str], None],
) -> MetricsEndpoint:
    """Serve this rank's metrics and write its endpoint files; raises ConfigError for a busy port."""
    assert cfg.metrics_port is not None, "start_exporter needs monitor.metrics_port"
    client = _import_client()
    rank, local_rank = launched_rank(), launched_local_rank()
    key = (out_dir.resolve(), run, rank)
    if key not in _EXPORTERS:
        _EXPORTERS[key] = MetricsExporter(client.CollectorRegistry(), rank=rank, run=run,
                                          tokens_per_step=tokens_per_step)  # fmt: skip
    exporter = _EXPORTERS[key]
    port = cfg.metrics_port + local_rank if cfg.metrics_port else 0
    if port > 65535:
        raise ConfigError(
            "monitor.metrics_port", f"{cfg.metrics_port} + local rank {local_rank} is over 65535"
        )
    server, thread = _serve(client, exporter.registry, cfg.metrics_host, port, local_rank)
    target = f"{_display_host(cfg.metrics_host)}:{server.server_port}"
    endpoint = MetricsEndpoint(exporter, server, thread, f"http://{target}/metrics")
    directory = out_dir / ENDPOINTS_DIR
    try:
        endpoint.files.append(directory / f"rank-{rank}.json")
        info = {"rank": rank, "local_rank": local_rank, "run": run, "url": endpoint.url, "pid": os.getpid()}
        _write_json(endpoint.files[-1], info)
        endpoint.files.append(directory / "file_sd" / f"rank-{rank}.json")
        _write_json(endpoint.files[-1], [{"targets": [target], "labels": {}}])
        endpoint.sampler = SystemSampler(
            exporter.publish_system,
            every_s=cfg.system_every_s,
            device=device,
            node_wide=local_rank == 0,
            warn=warn,
        ).start()
    except BaseException:
        endpoint.stop()
        raise
    return endpoint


def read_endpoints(out_dir: Path) -> list[dict[str, Any]]:
    """The endpoint files of a run's ranks, by rank (what `start_exporter` wrote and has not removed yet)."""
    found = []
    for path in (out_dir / ENDPOINTS_DIR).glob("rank-*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except FileNotFoundError:  # that rank stopped between the listing and the read
            continue
    return sorted(found, key=lambda info: int(info["rank"]))
