"""The HTTP face of `gaudi3 serve`, on the standard library: one handler thread per connection, all of them
feeding the one decode thread (`serve.engine`).

    GET  /health            200 {"status": "ok", "model": …, "engine": {counters}}   (HEAD: the same, no body)
    GET  /v1/models         OpenAI's model list (one model); GET /v1/models/<name> that model
    POST /v1/completions    OpenAI's completions, `stream: true` as Server-Sent Events

Responses are HTTP/1.0 (the connection closes after each), so a stream needs no chunked encoding and a shutdown
never waits on an idle keep-alive connection. Every answer, the standard library's own refusals included (a
malformed request line, headers too long), is OpenAI's JSON error shape; any method on any path is routed here
(405 with `Allow` where the path knows other methods), never the standard library's HTML 501.

Hostile clients get HTTP answers, not resets or stuck threads: the head and body of a request must arrive within
`client_timeout_s` in all (else 408), a body over `MAX_BODY_BYTES` is 413, and the listen backlog is at least
`LISTEN_BACKLOG_MIN` and the queue limit, so a burst of connections reaches the engine, which answers the ones it
cannot queue with 503 `queue_full` (the kernel caps the backlog at net.core.somaxconn, 4096 on Linux >= 5.4).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import select
import socket
import struct
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from gaudi3_scale.config import strict_json
from gaudi3_scale.serve.engine import Completion, Engine, EngineClosed, QueueFull
from gaudi3_scale.serve.loading import ServedModel
from gaudi3_scale.serve.protocol import (
    CompletionRequest,
    RequestError,
    clipped,
    completion_body,
    encode_prompt,
    error_body,
    new_completion_id,
    parse_completion_request,
    shown,
    sse_event,
    stream_chunk,
)

__all__ = [
    "CLIENT_TIMEOUT_S",
    "LISTEN_BACKLOG_MIN",
    "MAX_BODY_BYTES",
    "CompletionServer",
    "ServeApp",
    "listen_backlog",
]

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above a full-context prompt of the models served here
# An over-limit body up to this size is read and dropped before the 413: a client still sending it would get a
# connection reset instead of the answer (nginx's "lingering close" for the same reason).
DISCARD_LIMIT_BYTES = 16 << 20
CLIENT_TIMEOUT_S = 15.0  # default of --client-timeout-s
MAX_LINE_BYTES = 65536  # the request line or one header line (the standard library's limit too)
MAX_HEAD_BYTES = 65536
MAX_HEADERS = 100  # http.client's limit
LISTEN_BACKLOG_MIN = 1024  # uvicorn and gunicorn default to 2048, nginx to 511
ROUTES = {"/health": ("GET", "HEAD"), "/v1/models": ("GET", "HEAD"), "/v1/completions": ("POST",)}
_MODEL_PREFIX = "/v1/models/"


def listen_backlog(max_queue: int, max_batch_size: int) -> int:
    """Connections the kernel holds until accepted: never fewer than the requests the engine may hold at once, so
    an over-full burst is refused by the engine (503 `queue_full`) rather than reset by the kernel."""
    return max(LISTEN_BACKLOG_MIN, max_queue + max_batch_size)


@dataclass(frozen=True, kw_only=True)
class ServeApp:
    """What every handler reads: the engine, the model, the limits."""

    engine: Engine
    served: ServedModel
    max_prompt_tokens: int
    max_tokens_limit: int
    created_s: int  # the models list's `created`


class CompletionServer(ThreadingHTTPServer):
    """ThreadingHTTPServer whose `server_close()` waits for every handler, so no response is cut at shutdown. It
    knows its open connections, so that a shutdown can end the ones still open after its grace period."""

    daemon_threads = False
    block_on_close = True
    app: ServeApp  # set before serve_forever

    def __init__(self, address: tuple[str, int], *, backlog: int, client_timeout_s: float) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.request_queue_size = backlog  # what server_activate passes to listen()
        self.client_timeout_s = client_timeout_s
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:  # before its thread starts: `close_connections` never misses one
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def open_connections(self) -> int:
        with self._connections_lock:
            return len(self._connections)

    def answer_backlog(self) -> int:
        """Accept the connections the kernel already holds in the listen backlog and hand each to a handler
        (closing a listening socket resets them instead); call once `serve_forever` has returned. On Linux no
        new connection joins the backlog meanwhile (`_drop_new_connections`); elsewhere at most a backlog's worth
        is accepted, so that clients reconnecting at once cannot keep the listener open. The number accepted."""
        if sys.platform == "linux":
            # a sandbox that refuses socket filters (seccomp): new clients may then be reset, not refused
            with contextlib.suppress(OSError):
                _drop_new_connections(self.socket)
        self.socket.setblocking(False)
        for accepted in range(self.request_queue_size):
            try:
                request, client_address = self.socket.accept()
            except OSError:  # BlockingIOError: the backlog is empty
                return accepted
            request.setblocking(True)
            self.process_request(request, client_address)
        return self.request_queue_size

    def close_connections(self) -> int:
        """End every connection still open (shutdown past its grace): a handler reading or writing gets EOF or an
        error at once, so `server_close()` cannot wait on it. The number ended."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):  # closed by its handler meanwhile
                connection.shutdown(socket.SHUT_RDWR)
        return len(connections)


def _drop_new_connections(listener: socket.socket) -> None:
    """Attach a socket filter that drops every packet reaching the listening socket: a new client's SYN is
    dropped (its retry, 1 s later, finds the port closed: connection refused, not a reset after connecting), while
    the connections already in the backlog stay there to be accepted. One classic BPF instruction, `ret #0`
    (BPF_RET | BPF_K = 0x06: keep 0 bytes of the packet); Linux's SO_ATTACH_FILTER, socket(7)."""
    instruction = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0))  # struct sock_filter
    program = struct.pack("HL", 1, ctypes.addressof(instruction))  # struct sock_fprog: length, pointer
    listener.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_ATTACH_FILTER", 26), program)


def _methods(path: str) -> tuple[str, ...] | None:
    """The methods a path answers; None for an unknown path."""
    return ROUTES.get("/v1/models" if path.startswith(_MODEL_PREFIX) else path)


class _Handler(BaseHTTPRequestHandler):
    server: CompletionServer
    server_version = "gaudi3-serve"
    # not 0.9: the refusal of a malformed request line still gets a status line and headers
    default_request_version = "HTTP/1.0"

    def setup(self) -> None:
        super().setup()
        # until the request's own deadline takes over (handle_one_request)
        self.connection.settimeout(self.server.client_timeout_s)

    def handle_one_request(self) -> None:
        """One request (the connection then closes): its head and body within `client_timeout_s` in all, then
        `_route`, whatever the method."""
        self.close_connection = True
        self.requestline, self.command = "", ""  # until parse_request sets them
        self.request_version = self.default_request_version
        self._deadline = time.monotonic() + self.server.client_timeout_s
        try:
            try:
                head = self._read_head()
            except RequestError as exc:
                self._send_json(exc.status, exc.body())
                return
            if head is None:
                return  # connected and closed without a request (a TCP health probe)
            self.raw_requestline = head[0]
            socket_file, self.rfile = self.rfile, io.BytesIO(b"".join(head[1:]))
            self._refused = False
            try:
                parsed = self.parse_request()  # a refusal goes through send_error
            finally:
                self.rfile = socket_file
            if parsed:
                self._route(self.command)
            elif not self._refused:  # the standard library drops an empty request line without a word
                self.send_error(400, "Bad request syntax (an empty request line)")
        except (ConnectionError, TimeoutError):
            pass  # the client went away, or stopped reading what we write: there is nobody to answer

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own refusals (a malformed request line or headers), in OpenAI's error shape."""
        self.close_connection = self._refused = True
        text = " ".join((message or HTTPStatus(code).phrase).split())[:200].rstrip(".")
        self._send_json(code, error_body(f"{text}."))

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if str(code).isdigit() and int(code) < 400:
            return  # an access log line per completion would drown the errors
        super().log_request(code, size)

    def _timed_out(self, received: str) -> RequestError:
        return RequestError(408, f"The request did not arrive in full within {self.server.client_timeout_s:g} s "
                                 f"(got {received}); send the whole request at once.", code="request_timeout")  # fmt: skip

    def _until_deadline(self, received: str) -> None:
        """The socket waits no longer than what is left of the request's time; a 408 once none is."""
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise self._timed_out(received)
        self.connection.settimeout(remaining)

    def _read_head(self) -> list[bytes] | None:
        """The request line and header lines through the blank line; None when the client sent nothing at all.

        Read by what has arrived (`peek`: the buffer, or one recv), not `readline`: the deadline is checked before
        every recv, so a client sending one byte a second still gets its 408 on time (a socket timeout bounds each
        recv, and `readline` recvs until a newline). Bytes after the head stay in `rfile` for the body."""
        reader = self.rfile
        assert isinstance(reader, io.BufferedReader), "StreamRequestHandler.rbufsize is -1: a buffered file"
        lines: list[bytes] = []
        line = bytearray()  # the line being read (bytearray: appending a byte at a time stays linear)
        while not lines or lines[-1] not in (b"\r\n", b"\n"):
            received = f"{sum(map(len, lines)) + len(line)} bytes of its head"
            self._until_deadline(received)
            try:
                arrived = reader.peek(1)
            except TimeoutError:
                raise self._timed_out(received) from None
            if not arrived:
                if not lines and not line:
                    return None
                raise RequestError(400, "The request ended inside its head; send a complete HTTP request.")
            room = MAX_LINE_BYTES + 1 - len(line)
            end = arrived.find(b"\n", 0, room)
            line += reader.read(end + 1 if end >= 0 else min(len(arrived), room))
            if end < 0 and len(line) <= MAX_LINE_BYTES:
                continue
            lines.append(bytes(line))
            if len(line) > MAX_LINE_BYTES:
                raise RequestError(414 if len(lines) == 1 else 431,
                                   f"A line of the request head is over {MAX_LINE_BYTES} bytes.")  # fmt: skip
            line = bytearray()
            if len(lines) > MAX_HEADERS + 2 or sum(map(len, lines)) > MAX_HEAD_BYTES:
                raise RequestError(431, f"The request head has over {MAX_HEADERS} headers or {MAX_HEAD_BYTES} "
                                        "bytes.")  # fmt: skip
        return lines

    def _route(self, method: str) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        allowed = _methods(path)
        try:
            body = self._read_body()  # before any answer, so that an error never leaves a body unread
            if allowed is None:
                raise RequestError(404, f"Invalid URL ({clipped(f'{method} {path}')}): this server answers GET /health, "
                                        "GET /v1/models and POST /v1/completions.", code="unknown_url")  # fmt: skip
            if method not in allowed:
                raise RequestError(405, f"{clipped(method)} is not allowed on {path}; use {' or '.join(allowed)}.",
                                   code="method_not_allowed")  # fmt: skip
            if path == "/health":
                self._send_json(200, self._health())
            elif path.startswith("/v1/models"):
                self._send_json(200, self._models(path))
            else:
                self._complete(body)
        except RequestError as exc:
            headers = {"Allow": ", ".join(allowed)} if exc.status == 405 and allowed else {}
            self._send_json(exc.status, exc.body(), headers)
        except (ConnectionError, TimeoutError):
            pass  # the client went away; there is nobody to answer
        except Exception as exc:  # a bug: answer 500 rather than drop the connection, and say what happened
            traceback.print_exc(file=sys.stderr)
            self._send_json(
                500, error_body(f"Internal server error ({type(exc).__name__}).", kind="server_error")
            )

    def _send_json(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        # a client's lone surrogate quoted in an error stays a JSON escape (\ud800) rather than failing to encode
        data = strict_json.dumps(body, ensure_ascii=False).encode("utf-8", "backslashreplace")
        self.connection.settimeout(self.server.client_timeout_s)  # each write; reading had its own deadline
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _health(self) -> dict[str, Any]:
        app = self.server.app
        return {"status": "ok", "model": app.served.name, "engine": asdict(app.engine.stats())}

    def _models(self, path: str) -> dict[str, Any]:
        app = self.server.app
        card = {
            "id": app.served.name,
            "object": "model",
            "created": app.created_s,
            "owned_by": "gaudi3-scale",
        }
        if path == "/v1/models":
            return {"object": "list", "data": [card]}
        name = path[len(_MODEL_PREFIX) :]
        if name != app.served.name:
            raise RequestError(404, f"The model {shown(name)} does not exist; this server serves {app.served.name!r}.",
                               param="model", code="model_not_found")  # fmt: skip
        return card

    def _read_body(self) -> bytes:
        coding = self.headers.get("Transfer-Encoding", "").strip().lower()
        if "chunked" in coding:
            raise RequestError(
                411, "Send the body with a Content-Length header; chunked bodies are not accepted."
            )
        if coding not in ("", "identity"):  # RFC 9112 §6.1: a coding the server does not know is a 501
            raise RequestError(
                501, f"Transfer-Encoding {clipped(coding)!r} is not supported; send the body as is."
            )
        lengths = {value.strip() for value in self.headers.get_all("Content-Length") or []}
        if len(lengths) > 1:  # RFC 9112 §6.3: differing lengths make the message unreadable (and smugglable)
            raise RequestError(400, "The request has Content-Length headers that differ; send one.")
        length = self.headers.get("Content-Length", "0").strip()
        if not (length.isascii() and length.isdigit()):
            raise RequestError(400, f"Content-Length must be a number of bytes, got {length[:40]!r}.")
        size = (
            int(length) if len(length) <= 18 else DISCARD_LIMIT_BYTES + 1
        )  # never convert a 5,000-digit one
        if size > MAX_BODY_BYTES:
            self._discard(size)
            raise RequestError(413, f"The request body is {length[:40]} bytes, over this server's limit of "
                                    f"{MAX_BODY_BYTES} bytes; send a shorter prompt.")  # fmt: skip
        return self._receive(size)

    def _receive(self, size: int) -> bytes:
        """`size` body bytes, within the request's deadline (408), or a 400 when the client stops short."""
        chunks, received = [], 0
        while received < size:
            progress = f"{received} of {size} body bytes"
            self._until_deadline(progress)
            try:
                chunk = self.rfile.read1(min(size - received, 1 << 16))
            except TimeoutError:
                raise self._timed_out(progress) from None
            if not chunk:
                raise RequestError(400, f"The request body ended after {received} of its {size} bytes "
                                        "(Content-Length); send the whole body.")  # fmt: skip
            chunks.append(chunk)
            received += len(chunk)
        return b"".join(chunks)

    def _discard(self, size: int) -> None:
        """Read and drop an over-limit body (up to DISCARD_LIMIT_BYTES, within the deadline) before the 413."""
        left = size if size <= DISCARD_LIMIT_BYTES else 0
        try:
            while left > 0:
                self._until_deadline("a body over the limit")
                chunk = self.rfile.read1(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)
        except (RequestError, TimeoutError):
            pass  # the 413 goes out anyway

    def _complete(self, body: bytes) -> None:
        app = self.server.app
        request = parse_completion_request(
            body, served_model=app.served.name, max_tokens_limit=app.max_tokens_limit
        )
        prompt_ids = encode_prompt(
            request.prompt, app.served.tokenizer, max_prompt_tokens=app.max_prompt_tokens
        )
        try:
            completion = app.engine.submit(prompt_ids, request)
        except QueueFull:
            raise RequestError(503, f"The server is busy: {app.engine.max_queue} requests are already waiting "
                                    "(gaudi3 serve --max-queue); retry later.",
                               code="queue_full", kind="server_error") from None  # fmt: skip
        except EngineClosed:
            raise RequestError(503, "The server is shutting down; send the request again (to another replica).",
                               code="shutting_down", kind="server_error") from None  # fmt: skip
        if request.stream:
            self._stream(completion, request)
        else:
            self._respond(completion, request)

    def _client_gone(self) -> bool:
        """True once the client has closed the connection (EOF or a reset), seen without reading: HTTP/1.0 clients
        send nothing after their request, so a readable socket means they left (nginx checks the same way). A
        client that only half-closes (shutdown(SHUT_WR)) counts as gone too. poll, not select: a burst of over
        1,024 connections has descriptors above select's FD_SETSIZE."""
        poller = select.poll()
        poller.register(self.connection, select.POLLIN)
        if not poller.poll(0):
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (ConnectionError, TimeoutError, BlockingIOError):
            return True

    def _respond(self, completion: Completion, request: CompletionRequest) -> None:
        pieces, last = [request.prompt] if request.echo else [], None
        for delta in completion.deltas(self._client_gone):
            pieces.append(delta.text)
            last = delta
        if completion.cancelled.is_set():
            return  # the client left: its request left the queue or the batch, and nobody is there to answer
        assert last is not None and last.finish_reason is not None
        # Cancelled at shutdown (503: retry elsewhere) or a failed decode step (500).
        if last.finish_reason == "error":
            status = 500 if self.server.app.engine.accepting else 503
            raise RequestError(status, f"The completion was not finished: {last.error}.", kind="server_error")
        body = completion_body(new_completion_id(), request.model, text="".join(pieces),
                               finish_reason=last.finish_reason, prompt_tokens=len(completion.prompt_ids),
                               completion_tokens=last.completion_tokens)  # fmt: skip
        self._send_json(200, body)

    def _stream(self, completion: Completion, request: CompletionRequest) -> None:
        self.connection.settimeout(
            self.server.client_timeout_s
        )  # each write may wait this long for the client
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        completion_id, created_s = new_completion_id(), int(time.time())
        try:
            if request.echo:
                self.wfile.write(stream_chunk(completion_id, request.model, created_s, request.prompt))
            for delta in completion.deltas(self._client_gone):  # also while queued: no write fails then
                if delta.finish_reason == "error":  # the 200 is already sent: the failure goes as an event
                    message = f"The completion was not finished: {delta.error}."
                    self.wfile.write(sse_event(error_body(message, kind="server_error")))
                    break
                if delta.text:
                    self.wfile.write(stream_chunk(completion_id, request.model, created_s, delta.text))
                if delta.finish_reason is not None:
                    self.wfile.write(
                        stream_chunk(completion_id, request.model, created_s, "", delta.finish_reason)
                    )
            if not completion.cancelled.is_set():
                self.wfile.write(sse_event("[DONE]"))
        except (ConnectionError, TimeoutError):
            completion.cancel()  # the client left, or stopped reading: free its batch slot
