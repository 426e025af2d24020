"""Monitoring never stops training, and a tracker that cannot work is refused at once: an MLflow server that goes
down mid-run (a tiny REST server on 127.0.0.1 that answers 503 after a few metric batches) is switched off with one
warning line while the run finishes and metrics.jsonl keeps every record; an unreachable, host-less or uncreatable
tracking URI is one line and exit 2 within seconds; a metrics listener that raises is dropped."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.monitor.config import MonitorConfig
from gaudi3_scale.monitor.trackers import MLFLOW_HTTP_BOUNDS, build_trackers
from gaudi3_scale.train.step import StepState
from gaudi3_scale.train.step_metrics import RunMetrics

pytestmark = pytest.mark.integration

GAUDI3 = [sys.executable, "-m", "gaudi3_scale.cli"]
TINY = ["--sample-tokens", "0", "--no-progress", "--model.num_layers", "1", "--train.threads", "1",
        "--train.max_steps", "6", "--train.log_every_steps", "1", "--train.val_every_steps", "0",
        "--optim.warmup_steps", "2", "--checkpoint.enabled", "false"]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return {**env, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"), **extra}


def _fake_mlflow(artifacts: Path, fail_after_batches: int) -> http.server.ThreadingHTTPServer:
    """The REST calls MLFlowLogger makes; after `fail_after_batches` log-batch calls every request gets 503."""
    run_info = {"run_id": "r1", "run_uuid": "r1", "experiment_id": "1", "artifact_uri": artifacts.as_uri(),
                "status": "RUNNING", "lifecycle_stage": "active", "start_time": 0, "run_name": "x"}  # fmt: skip
    experiment = {"experiment_id": "1", "name": "x", "artifact_location": artifacts.as_uri(),
                  "lifecycle_stage": "active"}  # fmt: skip
    replies = {"experiments/get-by-name": {"experiment": experiment}, "experiments/create": {"experiment_id": "1"},
               "runs/create": {"run": {"info": run_info, "data": {}}},
               "runs/get": {"run": {"info": run_info, "data": {}}}, "runs/update": {"run_info": run_info}}  # fmt: skip
    batches = 0

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self) -> None:
            nonlocal batches
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path = self.path.split("?")[0]
            batches += path.endswith("runs/log-batch")
            if batches > fail_after_batches:
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = json.dumps(next((v for k, v in replies.items() if path.endswith(k)), {})).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PATCH = _reply

        def log_message(self, *args: Any) -> None:
            pass

    return http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture
def failing_mlflow(tmp_path: Path) -> Iterator[str]:
    server = _fake_mlflow(tmp_path / "artifacts", fail_after_batches=3)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_a_tracker_that_fails_mid_run_is_switched_off_and_the_run_finishes(
    tmp_path: Path, failing_mlflow: str
) -> None:
    out = tmp_path / "run"
    done = subprocess.run(
        [*GAUDI3, "train", "--out", str(out), *TINY, "--monitor.loggers", "mlflow",
         "--monitor.mlflow_tracking_uri", failing_mlflow],
        capture_output=True, text=True, timeout=300, env=_env(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    warnings = [line for line in done.stderr.splitlines() if "monitor.loggers: mlflow failed" in line]
    assert len(warnings) == 1, done.stderr
    assert warnings[0].startswith("warning: monitor.loggers: mlflow failed (log metrics: MlflowException: ")
    assert "off for the rest of the run" in warnings[0]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [1, 2, 3, 4, 5, 6]
    assert json.loads((out / "summary.json").read_text())["steps"] == 6


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_mlflow_uri_is_one_line_within_seconds(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    done = subprocess.run(
        [*GAUDI3, "train", "--out", str(tmp_path / "run"), *TINY, "--monitor.loggers", "mlflow",
         "--monitor.mlflow_tracking_uri", uri],
        capture_output=True, text=True, timeout=90, env=_env(),  # MLflow's own default: ~250 s of retries
    )  # fmt: skip
    elapsed_s = time.monotonic() - started
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"gaudi3: error: monitor.mlflow_tracking_uri: MLflow cannot use '{uri}': ")
    assert elapsed_s < 60, elapsed_s


def test_the_http_bounds_are_ours_only_where_the_user_set_none(monkeypatch: pytest.MonkeyPatch) -> None:
    from gaudi3_scale.monitor.trackers import prepare_mlflow_environment

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "300")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    prepare_mlflow_environment("http://127.0.0.1:5000")
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "300"
    assert (
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == MLFLOW_HTTP_BOUNDS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
    )
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    # The names MLflow documents, read on every request (mlflow.utils.rest_utils.http_request).
    assert {MLFLOW_HTTP_REQUEST_MAX_RETRIES.name, MLFLOW_HTTP_REQUEST_TIMEOUT.name} == set(MLFLOW_HTTP_BOUNDS)


@pytest.mark.parametrize("uri", ["http://", "https://:5000/", "http://host:port"])
def test_an_mlflow_uri_without_a_host_is_one_line_at_once(uri: str) -> None:
    done = subprocess.run([*GAUDI3, "train", "--print-config", "--monitor.mlflow_tracking_uri", uri],
                          capture_output=True, text=True, timeout=60, env=_env())  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("gaudi3: error: monitor.mlflow_tracking_uri: ") and repr(uri) in done.stderr
    assert done.stderr.count("\n") == 1


class _Listeners:
    def __init__(self) -> None:
        self.listeners: list[Any] = []


def test_a_file_store_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a directory\n")
    store = tmp_path / "afile" / "mlruns"
    monitor = MonitorConfig(loggers="mlflow", mlflow_tracking_uri=store.as_uri())
    with pytest.raises(ConfigError) as refused:
        build_trackers(monitor, run_name="x", hyperparameters={}, out_dir=tmp_path, metrics=_Listeners())
    assert str(refused.value) == (
        f"monitor.mlflow_tracking_uri: cannot create the MLflow file store at {store}: Not a directory"
    )


def test_a_metrics_listener_that_raises_is_dropped_after_the_record_is_written(tmp_path: Path) -> None:
    lines: list[str] = []
    metrics = RunMetrics(tmp_path / "metrics.jsonl", log_every_steps=1, state=StepState(),
                         peak_flops_per_device=None, data_parallel_size=1, warn=lines.append)  # fmt: skip
    metrics._is_writer = True  # what start() sets on global rank 0
    seen: list[int] = []

    def exporter(record: dict[str, Any]) -> None:
        raise OSError(28, "No space left on device")

    def tracker(record: dict[str, Any]) -> None:  # the record is in the file before a listener sees it
        assert (tmp_path / "metrics.jsonl").read_text().splitlines()[-1] == json.dumps(record)
        seen.append(record["step"])

    metrics.listeners += [exporter, tracker]
    for step in (1, 2):
        metrics.event({"step": step, "health_event": "loss_spike"})
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]
    assert seen == [1, 2]
    assert lines == [
        "metrics listener test_a_metrics_listener_that_raises_is_dropped_after_the_record_is_written.<locals>."
        "exporter failed (OSError: [Errno 28] No space left on device); it gets no more records this run, "
        "training goes on"
    ]
