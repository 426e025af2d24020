"""A real S3 server for tests: moto's app in werkzeug's threaded HTTP server on 127.0.0.1, stoppable and restartable.

Imported by tests as `from s3_server import …` (pytest puts `tests/` on sys.path, as for `fake_device.py`).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http import HTTPStatus
from typing import Any

import pytest

__all__ = ["S3Server", "free_port", "running_s3_server", "s3_options"]

_S3_ERROR = '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{code} (test)</Message></Error>'


class S3Server:
    """moto's S3 app in werkzeug's threaded HTTP server (what `moto.server.ThreadedMotoServer` runs).

    Run directly rather than via ThreadedMotoServer because its stop() neither closes the listening socket (clients
    would hang instead of being refused, and the port could not be bound again) nor returns before the next 0.5 s
    poll. moto keeps its state in module globals, so a restarted server still has the bucket and objects.
    `requests` records (method, path) of every request served, for tests that count downloads. `answer(status,
    code, times)` makes the next `times` requests get that S3 error (`403, "AccessDenied"`, `503, "ServiceUnavailable"`)
    instead of moto's answer, as a store that refuses or is overloaded sends it.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.running = False
        self.requests: list[tuple[str, str]] = []
        self._errors: list[list[Any]] = []  # [status, code, times left]
        self._lock = threading.Lock()

    def answer(self, status: int, code: str, times: int = 1 << 30) -> None:
        with self._lock:
            self._errors.append([status, code, times])

    def reset(self) -> None:
        with self._lock:
            self._errors.clear()

    def _error(self) -> tuple[int, str] | None:
        with self._lock:
            for rule in self._errors:
                if rule[2] > 0:
                    rule[2] -= 1
                    return rule[0], rule[1]
        return None

    def start(self) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        app = DomainDispatcherApplication(create_backend_app)

        def recording_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            self.requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")))
            if (error := self._error()) is None:
                return app(environ, start_response)
            status, code = error
            body = b"" if environ["REQUEST_METHOD"] == "HEAD" else _S3_ERROR.format(code=code).encode()
            start_response(f"{status} {HTTPStatus(status).phrase}",
                           [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])  # fmt: skip
            return [body]

        self._server = make_server(
            "127.0.0.1", self.port, recording_app, threaded=True, request_handler=MotoRequestHandler
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self._thread.start()
        self.running = True

    def stop(self) -> None:
        assert self._thread is not None
        self._server.shutdown()
        self._server.server_close()  # refuse new connections from now on
        self._thread.join()
        self.running = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def s3_options(port: int) -> dict[str, Any]:
    """s3fs storage options for the server on `port`; botocore retries off, so the code under test does them."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "eu-west-1"},
        # Fail fast while the server is down; the code under test does the retrying.
        "config_kwargs": {"connect_timeout": 1, "read_timeout": 5, "retries": {"max_attempts": 1}},
    }


@contextmanager
def running_s3_server(bucket: str) -> Iterator[tuple[S3Server, dict[str, Any]]]:
    """A started server holding an empty `bucket` (skips without s3fs or moto), and its storage options."""
    pytest.importorskip("s3fs", reason="needs the `remote` extra")
    pytest.importorskip("moto", reason="needs moto (test extra)")
    from gaudi3_scale.storage import open_remote

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = S3Server(free_port())
    server.start()
    try:
        options = s3_options(server.port)
        fs, _ = open_remote(f"s3://{bucket}", options, field="test")
        if not fs.exists(bucket):  # moto's state outlives a server: another test module may have made it
            fs.mkdir(bucket)
        yield server, options
    finally:
        server.stop()
