"""A plain HTTP store for tests: a directory served on 127.0.0.1 by `ThreadingHTTPServer`, with misbehaviours.

Imported by tests as `from http_store import …` (pytest puts `tests/` on sys.path, as for `s3_server.py`). fsspec's
http:// backend reads a prepared dataset from it like from any store; `HttpStore.behave(name, mode, times)` makes the
next `times` requests (GET or HEAD) for a file whose name ends with `name` misbehave:
  * `status:503` (any status): answer it, with a short text body;
  * `stall`: send the headers and 100 bytes of the body, then nothing until the server stops;
  * `hang`: answer nothing at all (neither the headers of a GET nor of a HEAD) until the server stops;
  * `html`: answer 200 with an HTML page (a captive portal, a proxy's error page).
`requests` records (method, path) of every request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["HttpStore", "running_http_store"]

HTML = b"<html><body><h1>503 Service Unavailable</h1>proxy error</body></html>"


class HttpStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[tuple[str, str]] = []
        self._rules: list[list[object]] = []  # [suffix, mode, times left]
        self._lock = threading.Lock()
        self._closing = threading.Event()
        store = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                store._serve(self, head=True)

            def do_GET(self) -> None:
                store._serve(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def behave(self, suffix: str, mode: str, times: int = 1 << 30) -> None:
        with self._lock:
            self._rules.append([suffix, mode, times])

    def reset(self) -> None:
        with self._lock:
            self._rules.clear()

    def _mode(self, path: str) -> str | None:
        with self._lock:
            for rule in self._rules:
                suffix, mode, left = rule
                if path.endswith(str(suffix)) and isinstance(left, int) and left > 0:
                    rule[2] = left - 1
                    return str(mode)
        return None

    def _serve(self, handler: BaseHTTPRequestHandler, *, head: bool) -> None:
        path = handler.path.split("?")[0]
        self.requests.append((handler.command, path))
        mode = self._mode(path)
        file = self.root / path.lstrip("/")
        if mode is not None and mode.startswith("status:"):
            return self._send(handler, int(mode.split(":")[1]), b"busy, retry", head=head)
        if mode == "hang":
            self._closing.wait()
            handler.close_connection = True
            return None
        if mode == "html":
            return self._send(handler, 200, HTML, head=head)
        if not file.is_file():
            return self._send(handler, 404, b"not found", head=head)
        data = file.read_bytes()
        if mode == "stall":
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            if not head:
                handler.wfile.write(data[:100])
                handler.wfile.flush()
                self._closing.wait()
            handler.close_connection = True
            return None
        start, end = 0, len(data)
        if (ranged := handler.headers.get("Range")) and ranged.startswith("bytes="):
            first, _, last = ranged.removeprefix("bytes=").partition("-")
            start, end = int(first or 0), min(len(data), int(last) + 1 if last else len(data))
            return self._send(handler, 206, data[start:end], head=head, total=len(data), start=start)
        return self._send(handler, 200, data, head=head)

    @staticmethod
    def _send(
        handler: BaseHTTPRequestHandler,
        status: int,
        body: bytes,
        *,
        head: bool,
        total: int = 0,
        start: int = 0,
    ) -> None:
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(body)))
        if status == 206:
            handler.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{total}")
        handler.send_header("Accept-Ranges", "bytes")
        handler.end_headers()
        if not head:
            handler.wfile.write(body)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._closing.set()  # stalled answers end
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


@contextmanager
def running_http_store(root: Path) -> Iterator[HttpStore]:
    store = HttpStore(root)
    store.start()
    try:
        yield store
    finally:
        store.stop()
