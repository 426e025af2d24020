"""What the spot-interruption watcher takes for a notice, against a real instance-metadata server on 127.0.0.1: only
AWS's `instance-action` JSON stops a run (exit 143 is restartable, so a stray HTTP 200 would stop and restart it in a
loop); a token that cannot be sent as a header is one warning and the watcher polls without it, never blind in
silence."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gaudi3_scale.train.spot import SpotInterruptionWatcher, parse_notice

pytestmark = pytest.mark.integration

PATH = "/latest/meta-data/spot/instance-action"
NOTICE = json.dumps({"action": "stop", "time": "2026-11-30T10:00:00Z"})


class _Metadata(ThreadingHTTPServer):
    token = "AQAEAgoodtoken"  # what PUT /latest/api/token answers
    require_token = False  # GET without the token: 401 (IMDSv2 only)
    body = NOTICE  # what GET answers, with 200
    drip_s = 0.0  # > 0: GET's body is sent a byte at a time, this long apart
    gets: list[str | None]  # the token header of every GET


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
        self._reply(200, self.server.token)

    def do_GET(self) -> None:
        sent = self.headers.get("X-aws-ec2-metadata-token")
        self.server.gets.append(sent)
        if self.server.require_token and sent != self.server.token.strip():
            return self._reply(401)
        if not self.server.drip_s:
            return self._reply(200, self.server.body)
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.server.body)))
        self.end_headers()
        try:
            for byte in self.server.body.encode():
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(self.server.drip_s)
        except OSError:  # the watcher gave up: expected
            pass


@pytest.fixture
def metadata() -> Iterator[_Metadata]:
    server = _Metadata(("127.0.0.1", 0), _Handler)
    server.gets = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _watcher(server: _Metadata, warnings: list[str]) -> SpotInterruptionWatcher:
    url = f"http://127.0.0.1:{server.server_address[1]}{PATH}"
    return SpotInterruptionWatcher(url, lambda text: None, timeout_s=2.0, warn=warnings.append)


@pytest.mark.parametrize(
    "body",
    ["<html>oops</html>", "", "[1, 2]", '{"action": "reboot", "time": "2026-11-30T10:00:00Z"}', '{"action": "stop"}'],
    ids=["html", "empty", "json-list", "unknown-action", "no-time"],
)  # fmt: skip
def test_a_200_that_is_not_a_notice_is_one_warning_and_watching_goes_on(
    metadata: _Metadata, body: str
) -> None:
    metadata.body = body
    warnings: list[str] = []
    watcher = _watcher(metadata, warnings)
    assert [watcher.poll() for _ in range(3)] == [None, None, None]
    assert len(warnings) == 1 and "HTTP 200 that is not an interruption notice" in warnings[0], warnings
    assert "still polling" in warnings[0] and "\n" not in warnings[0]
    metadata.body = NOTICE  # the real notice, when it comes, still stops the run
    assert watcher.poll() == NOTICE and len(warnings) == 1


def test_the_three_aws_actions_are_notices() -> None:
    for action in ("stop", "terminate", "hibernate"):
        assert parse_notice(json.dumps({"action": action, "time": "2026-11-30T10:00:00Z"})) is None
    assert parse_notice("oops") == "not JSON"


def test_a_token_with_a_line_break_is_one_warning_and_the_notice_is_still_seen(metadata: _Metadata) -> None:
    metadata.token = "AQAEA\nxyz"
    warnings: list[str] = []
    watcher = _watcher(metadata, warnings)
    assert watcher.poll() == NOTICE  # the request left, without the token (IMDSv1)
    assert metadata.gets == [None]
    assert (
        len(warnings) == 1
        and "cannot be sent as a header" in warnings[0]
        and "polling without" in warnings[0]
    )
    assert "xyz" not in warnings[0]  # a token is a credential: never printed


def test_a_trailing_newline_is_stripped_from_the_token(metadata: _Metadata) -> None:
    metadata.token, metadata.require_token = "AQAEAgoodtoken\n", True
    warnings: list[str] = []
    assert _watcher(metadata, warnings).poll() == NOTICE
    assert metadata.gets == ["AQAEAgoodtoken"] and warnings == []


def test_imdsv2_only_with_an_unusable_token_says_that_no_notice_can_be_seen(metadata: _Metadata) -> None:
    metadata.token, metadata.require_token = "bad token", True
    warnings: list[str] = []
    watcher = _watcher(metadata, warnings)
    assert [watcher.poll() for _ in range(3)] == [None, None, None]
    assert metadata.gets == [None, None, None]  # every poll asked: watching goes on
    assert len(warnings) == 2, warnings
    assert "cannot be sent as a header" in warnings[0]
    assert "wants a token (HTTP 401)" in warnings[1] and "no interruption notice can be seen" in warnings[1]


def test_a_service_that_answers_a_byte_at_a_time_is_cut_off_at_the_timeout(metadata: _Metadata) -> None:
    metadata.drip_s = 0.1  # every read returns within the timeout; the whole notice takes 5 s
    warnings: list[str] = []
    watcher = SpotInterruptionWatcher(
        f"http://127.0.0.1:{metadata.server_address[1]}{PATH}",
        lambda text: None,
        timeout_s=1.0,
        warn=warnings.append,
    )
    start = time.monotonic()
    assert watcher.poll() is None
    assert time.monotonic() - start < 3.0
    assert len(warnings) == 1 and "timed out: no complete answer within 1 s" in warnings[0], warnings


def test_a_run_whose_metadata_url_answers_a_web_page_trains_to_the_end(
    metadata: _Metadata, tmp_path: Path
) -> None:
    metadata.body = "<html>oops</html>"
    url = f"http://127.0.0.1:{metadata.server_address[1]}{PATH}"
    proc = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(tmp_path), "--no-progress",
         "--sample-tokens", "0", "--train.threads", "2", "--model.num_layers", "1", "--train.max_steps", "4",
         "--train.val_every_steps", "0", "--train.spot_watch", "true", "--train.spot_url", url,
         "--train.spot_poll_s", "0.05"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["stop_reason"] is None
    assert len(metadata.gets) > 1  # polled more than once: the watcher kept going
    lines = [line for line in proc.stderr.splitlines() if "not an interruption notice" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
