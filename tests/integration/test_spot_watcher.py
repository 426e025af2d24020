"""The spot-interruption watcher against a local instance-metadata server (IMDSv2 token flow, 404 until notice)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gaudi3_scale.checkpoint.manifest import verify_checkpoint
from gaudi3_scale.train.spot import SpotInterruptionWatcher

pytestmark = pytest.mark.integration

TOKEN = "token-123"
NOTICE = json.dumps({"action": "terminate", "time": "2026-11-22T12:00:00Z"})
PATH = "/latest/meta-data/spot/instance-action"


class _Metadata(ThreadingHTTPServer):
    notice_after_polls = 10**9  # polls answered 404 before the notice appears
    imdsv2 = True
    polls = 0
    tokens_issued = 0


class _Handler(BaseHTTPRequestHandler):
    server: _Metadata

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, code: int, body: str = "") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        if not self.server.imdsv2 or self.path != "/latest/api/token":
            return self._reply(405)
        assert self.headers["X-aws-ec2-metadata-token-ttl-seconds"]
        self.server.tokens_issued += 1
        self._reply(200, TOKEN)

    def do_GET(self) -> None:
        if self.path != PATH:
            return self._reply(404)
        if self.server.imdsv2 and self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
            return self._reply(401)
        self.server.polls += 1
        self._reply(200, NOTICE) if self.server.polls > self.server.notice_after_polls else self._reply(404)


@pytest.fixture
def metadata() -> Iterator[_Metadata]:
    server = _Metadata(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server: _Metadata) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}{PATH}"


@pytest.mark.parametrize("imdsv2", [True, False], ids=["imdsv2-token", "no-token-service"])
def test_watcher_reports_the_notice_once_after_404s(metadata: _Metadata, imdsv2: bool) -> None:
    metadata.imdsv2, metadata.notice_after_polls = imdsv2, 3
    seen: list[str] = []
    done = threading.Event()
    watcher = SpotInterruptionWatcher(_url(metadata), lambda t: (seen.append(t), done.set()), poll_s=0.05)
    watcher.start()
    assert done.wait(10)
    watcher.stop()
    assert seen == [NOTICE] and metadata.polls == 4
    assert metadata.tokens_issued == (1 if imdsv2 else 0)


def test_unreachable_metadata_service_means_no_notice() -> None:
    watcher = SpotInterruptionWatcher("http://127.0.0.1:9/none", lambda t: None, timeout_s=0.5)
    assert watcher.poll() is None


def test_spot_notice_stops_training_with_a_checkpoint_and_exit_143(
    metadata: _Metadata, tmp_path: Path
) -> None:
    metadata.notice_after_polls = 15  # ~3 s in: training is under way
    proc = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(tmp_path), "--no-progress",
         "--sample-tokens", "0", "--train.threads", "2", "--train.max_steps", "5000",
         "--train.val_every_steps", "0", "--train.spot_watch", "true", "--train.spot_url", _url(metadata),
         "--train.spot_poll_s", "0.2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 143, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_signal"] == "SIGTERM" and 0 < summary["steps"] < 5000
    assert summary["stop_reason"] == f"spot interruption notice ({NOTICE})"
    assert f"stopped by spot interruption notice ({NOTICE}) after step {summary['steps']}" in " ".join(
        proc.stderr.split()
    )
    step_dir = tmp_path / "checkpoints" / f"step-{summary['steps']:08d}"
    assert verify_checkpoint(step_dir) == []
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == step_dir.name
    assert summary["signal_to_checkpoint_s"] is not None and summary["signal_to_checkpoint_s"] > 0
