"""One JSON GET for the public price APIs (Azure Retail Prices, GCP Cloud Billing Catalog), with the standard library.

Every failure is one `SpotPriceError` line that names what was asked (`where`): an HTTP status (with the API's own
error message when it sends one), a refused connection, a timeout, a body that is not a JSON object. Redirects are
refused rather than followed: urllib would resend our headers (an API key) to wherever a 3xx points. The URL is
never part of a message, so a key in it could not leak either (we send keys in headers anyway).
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from gaudi3_scale.metering.quotes import SpotPriceError

__all__ = ["MAX_PAGES", "get_json", "open_bounded", "same_origin"]

MAX_PAGES = 50  # pages followed per quote: a GCP Compute Engine catalog is a few pages of 5,000 SKUs
_MAX_BODY_BYTES = 64 * 1024 * 1024  # one page; a page of 5,000 SKUs is a few MB
_QUOTED_CHARS = 160  # of an API's error message


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises HTTPError with the 3xx status


class _DeadlineSocket:
    """A connected socket whose every send and receive waits at most until `deadline` (time.monotonic()).

    A socket timeout bounds each read on its own: a server that sends one byte per second never trips it, and a
    4 KB answer would take over an hour. Before each operation the timeout is set to the time left, so the whole
    exchange (headers and body) ends by the deadline. Everything else is the socket's own.
    """

    def __init__(self, sock: socket.socket, deadline: float, timeout_s: float) -> None:
        self._sock = sock
        self._deadline = deadline
        self._timeout_s = timeout_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def _bounded(self, operation: Callable[..., Any], *args: Any) -> Any:
        left = self._deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            self._sock.settimeout(left)
            return operation(*args)
        except TimeoutError:  # one message whether the answer stalled or dripped past the deadline
            raise TimeoutError(f"timed out: no complete answer within {self._timeout_s:g} s") from None

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        return int(self._bounded(self._sock.recv_into, buffer, nbytes, flags))

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        return bytes(self._bounded(self._sock.recv, bufsize, flags))

    def sendall(self, data: Any, flags: int = 0) -> None:
        self._bounded(self._sock.sendall, data, flags)

    def makefile(self, mode: str = "rb", **kwargs: Any) -> Any:
        # http.client reads the answer through this file, so its reads must come back through `recv_into` above.
        # As socket.makefile does, the file holds a reference: urllib closes the connection's socket once the
        # headers are in, and the socket stays open until the file is closed too.
        assert mode == "rb", mode
        reader = io.BufferedReader(socket.SocketIO(self, "rb"))  # type: ignore[arg-type]
        self._sock._io_refs += 1  # type: ignore[attr-defined]
        return reader


class _DeadlineConnection:
    """Mixed into http.client's connection classes: the socket, once connected (TLS included), is a `_DeadlineSocket`."""

    sock: Any

    def __init__(self, *args: Any, deadline: float, timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline, self._timeout_s = deadline, timeout_s

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self.sock = _DeadlineSocket(self.sock, self._deadline, self._timeout_s)


class _DeadlineHTTP(_DeadlineConnection, http.client.HTTPConnection):
    pass


class _DeadlineHTTPS(_DeadlineConnection, http.client.HTTPSConnection):
    pass


_WITH_DEADLINE = {http.client.HTTPConnection: _DeadlineHTTP, http.client.HTTPSConnection: _DeadlineHTTPS}


class _Deadline(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """http and https whose request, from connecting to the last byte of the answer, ends within the timeout."""

    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        timeout_s = req.timeout
        connection: Any = partial(
            _WITH_DEADLINE[http_class], deadline=time.monotonic() + timeout_s, timeout_s=timeout_s
        )
        return super().do_open(connection, req, **kwargs)


_OPENER = urllib.request.build_opener(_RefuseRedirects(), _Deadline())


def open_bounded(request: urllib.request.Request, *, timeout_s: float) -> Any:
    """`urllib.request.urlopen`, but the whole request (connecting, sending, every read of the answer) ends within
    `timeout_s` (a TimeoutError after), and a redirect is an HTTPError rather than followed."""
    return _OPENER.open(request, timeout=timeout_s)


def _api_message(body: bytes) -> str:
    """The message of a JSON error body (Google's `{"error": {"message": …}}`, or capitalised), or ''."""
    try:
        answer = json.loads(body)
        error = answer.get("error") or answer.get("Error")
        message = error.get("message") or error.get("Message")
    except (ValueError, AttributeError):  # not JSON, or not that shape
        return ""
    return f": {' '.join(str(message).split())[:_QUOTED_CHARS]}" if message else ""


def get_json(
    url: str, *, where: str, timeout_s: float, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """GET `url` and parse a JSON object; the whole request (connecting, sending, every read) ends within
    `timeout_s`, or it is a SpotPriceError saying it timed out."""
    request = urllib.request.Request(
        url, headers={"Accept": "application/json", "User-Agent": "gaudi3-scale", **(headers or {})}
    )
    try:
        with open_bounded(request, timeout_s=timeout_s) as response:
            body = response.read(_MAX_BODY_BYTES + 1)
    except urllib.error.HTTPError as exc:
        try:
            detail = _api_message(exc.read())
        except OSError:
            detail = ""
        raise SpotPriceError(f"{where}: HTTP {exc.code} {exc.reason}{detail}") from None
    except urllib.error.URLError as exc:
        raise SpotPriceError(f"{where}: {type(exc.reason).__name__}: {exc.reason}") from None
    except (OSError, http.client.HTTPException) as exc:  # a timeout or reset while reading the body
        raise SpotPriceError(f"{where}: {type(exc).__name__}: {exc or 'no detail'}") from None
    if len(body) > _MAX_BODY_BYTES:
        raise SpotPriceError(f"{where}: the answer is larger than {_MAX_BODY_BYTES // 2**20} MiB")
    try:
        data = json.loads(body)
    except ValueError:
        raise SpotPriceError(f"{where}: the answer is not JSON: {body[:60]!r}") from None
    if not isinstance(data, dict):
        raise SpotPriceError(f"{where}: expected a JSON object, got {type(data).__name__}")
    return data


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port


def same_origin(url: str, base: str) -> bool:
    """Whether `url` (a next-page link from an answer) points at the same scheme, host and port as `base`."""
    return _origin(url) == _origin(base)
