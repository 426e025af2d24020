"""The HTTP face of `gaudi3 serve`, on the standard library: one handler thread per connection, all of them
feeding the one decode thread (`serve.engine`).

    GET  /health            200 {"status": "ok", "model": …, "engine": {counters}}
    GET  /v1/models         OpenAI's model list (one model); GET /v1/models/<name> that model
    POST /v1/completions    OpenAI's completions, `stream: true` as Server-Sent Events

Responses are HTTP/1.0 (the connection closes after each), so a stream needs no chunked encoding and a shutdown
never waits on an idle keep-alive connection.
"""

from __future__ import annotations

import json
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from gaudi3_scale.serve.engine import Completion, Engine, EngineClosed, QueueFull
from gaudi3_scale.serve.loading import ServedModel
from gaudi3_scale.serve.protocol import (
    CompletionRequest,
    RequestError,
    completion_body,
    encode_prompt,
    error_body,
    new_completion_id,
    parse_completion_request,
    sse_event,
    stream_chunk,
)

__all__ = ["MAX_BODY_BYTES", "CompletionServer", "ServeApp"]

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above a full-context prompt of the models served here
# An over-limit body up to this size is read and dropped before the 413: a client still sending it would get a
# connection reset instead of the answer (nginx's "lingering close" for the same reason).
DISCARD_LIMIT_BYTES = 16 << 20
HANDLER_TIMEOUT_S = 15.0  # a connection that sends no complete request in this time is closed
ROUTES = {"/health": "GET", "/v1/models": "GET", "/v1/completions": "POST"}
_MODEL_PREFIX = "/v1/models/"


@dataclass(frozen=True, kw_only=True)
class ServeApp:
    """What every handler reads: the engine, the model, the limits."""

    engine: Engine
    served: ServedModel
    max_prompt_tokens: int
    max_tokens_limit: int
    created_s: int  # the models list's `created`


class CompletionServer(ThreadingHTTPServer):
    """ThreadingHTTPServer whose `server_close()` waits for every handler, so no response is cut at shutdown."""

    daemon_threads = False
    block_on_close = True
    app: ServeApp  # set before serve_forever

    def __init__(self, address: tuple[str, int]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: CompletionServer
    server_version = "gaudi3-serve"
    timeout = HANDLER_TIMEOUT_S

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def do_PATCH(self) -> None:
        self._route("PATCH")

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if str(code).isdigit() and int(code) < 400:
            return  # an access log line per completion would drown the errors
        super().log_request(code, size)

    def _route(self, method: str) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            body = self._read_body()  # before any answer, so that an error never leaves a body unread
            allowed = ROUTES.get("/v1/models" if path.startswith(_MODEL_PREFIX) else path)
            if allowed is None:
                raise RequestError(404, f"Invalid URL ({method} {path}): this server answers GET /health, "
                                        "GET /v1/models and POST /v1/completions.", code="unknown_url")  # fmt: skip
            if method != allowed:
                raise RequestError(405, f"{method} is not allowed on {path}; use {allowed}.",
                                   code="method_not_allowed")  # fmt: skip
            if path == "/health":
                self._send_json(200, self._health())
            elif path.startswith("/v1/models"):
                self._send_json(200, self._models(path))
            else:
                self._complete(body)
        except RequestError as exc:
            headers = {"Allow": ROUTES.get(path, "GET")} if exc.status == 405 else {}
            self._send_json(exc.status, exc.body(), headers)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away; there is nobody to answer
        except Exception as exc:  # a bug: answer 500 rather than drop the connection, and say what happened
            traceback.print_exc(file=sys.stderr)
            self._send_json(
                500, error_body(f"Internal server error ({type(exc).__name__}).", kind="server_error")
            )

    def _send_json(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
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
            raise RequestError(404, f"The model {name!r} does not exist; this server serves {app.served.name!r}.",
                               param="model", code="model_not_found")  # fmt: skip
        return card

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise RequestError(
                411, "Send the body with a Content-Length header; chunked bodies are not accepted."
            )
        length = self.headers.get("Content-Length", "0").strip()
        if not length.isdigit():
            raise RequestError(400, f"Content-Length must be a number of bytes, got {length!r}.")
        size = int(length)
        if size > MAX_BODY_BYTES:
            self._discard(size)
            raise RequestError(413, f"The request body is {size} bytes, over this server's limit of "
                                    f"{MAX_BODY_BYTES} bytes; send a shorter prompt.")  # fmt: skip
        return self.rfile.read(size)

    def _discard(self, size: int) -> None:
        left = size if size <= DISCARD_LIMIT_BYTES else 0
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                break
            left -= len(chunk)

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

    def _respond(self, completion: Completion, request: CompletionRequest) -> None:
        pieces, last = [request.prompt] if request.echo else [], None
        for delta in completion.deltas():
            pieces.append(delta.text)
            last = delta
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
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        completion_id, created_s = new_completion_id(), int(time.time())
        try:
            if request.echo:
                self.wfile.write(stream_chunk(completion_id, request.model, created_s, request.prompt))
            for delta in completion.deltas():
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
            self.wfile.write(sse_event("[DONE]"))
        except (BrokenPipeError, ConnectionResetError):
            completion.cancel()  # the client left: free its batch slot
