"""Start and stop `gaudi3 serve`: bind, load, serve until SIGTERM / SIGINT, then drain.

Shutdown, in this order: stop accepting connections and requests, answering the connections already in the listen
backlog (503 `shutting_down`; on Linux new ones are kept out of it meanwhile: refused, not reset); let the engine
finish what it holds (queued requests too) for up to `DRAIN_GRACE_S`, then cancel the rest (those clients get an
error, not a cut-off text); wait for every handler to finish writing, until the same grace ends (plus
`ANSWER_GRACE_S`); then end the connections still open (a client still trickling its request), so no client can
hold the process. A second signal cancels at once and ends the connections `ANSWER_GRACE_S` later. Kubernetes
waits 30 s after SIGTERM by default (terminationGracePeriodSeconds), hence 25 s.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.serve.decoding import KvCacheMode
from gaudi3_scale.serve.engine import Engine
from gaudi3_scale.serve.loading import ModelSource, load_served_model
from gaudi3_scale.serve.server import CLIENT_TIMEOUT_S, LISTEN_BACKLOG_MIN, CompletionServer, ServeApp

__all__ = ["DRAIN_GRACE_S", "bind_server", "build_app", "serve_until_signal", "server_url"]

DRAIN_GRACE_S = 25.0
# After the drain (or a second signal), handlers whose requests were just cancelled write their 503 or error event
# (milliseconds); only what is still open after this is ended.
ANSWER_GRACE_S = 1.0


def bind_server(
    host: str, port: int, *, backlog: int = LISTEN_BACKLOG_MIN, client_timeout_s: float = CLIENT_TIMEOUT_S
) -> CompletionServer:
    """The HTTP server, listening (not yet serving); one line when the address cannot be used. `backlog`: see
    `server.listen_backlog`; `client_timeout_s`: the time a client has to send its request, and each write to it."""
    if not host.strip():
        raise UserInputError("--host: expected an address such as 127.0.0.1 or 0.0.0.0")
    try:
        return CompletionServer((host, port), backlog=backlog, client_timeout_s=client_timeout_s)
    except socket.gaierror as exc:
        raise UserInputError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UserInputError(f"--host {host} --port {port}: cannot listen there ({reason})") from None


def server_url(host: str, server: CompletionServer) -> str:
    """The URL clients use: the address asked for, with the port bound (the real one for --port 0)."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{server.server_port}"


def build_app(
    source: ModelSource,
    *,
    tokenizer_dir: Path | None,
    name: str | None,
    max_batch_size: int,
    max_queue: int,
    max_prompt_tokens: int | None,
    max_tokens_limit: int,
    kv_cache: KvCacheMode = "dynamic",
) -> ServeApp:
    """Load the model; its engine is built, not yet running (`serve_until_signal` runs it)."""
    served = load_served_model(source, tokenizer_dir=tokenizer_dir, name=name)
    engine = Engine(served.model, served.tokenizer, max_batch_size=max_batch_size, max_queue=max_queue,
                    kv_cache=kv_cache)  # fmt: skip
    return ServeApp(
        engine=engine,
        served=served,
        max_prompt_tokens=max_prompt_tokens or served.config.context_length,
        max_tokens_limit=max_tokens_limit,
        created_s=int(time.time()),
    )


def serve_until_signal(
    server: CompletionServer, app: ServeApp, echo: Callable[[str], None], *, ready_line: str
) -> None:
    """Serve until SIGTERM or SIGINT, then drain (see the module docstring); returns once everything is closed.
    `ready_line` is echoed once the signals are handled: a SIGTERM sent right after it drains (before, it would
    kill the process and reset the connections in the backlog).

    The decode loop runs in this (the main) thread and HTTP in a second one: the model was loaded here, and on CPU
    PyTorch's OpenMP pool belongs to the thread that made it; decoding from another thread measured 3-4x slower
    per token for small models (benchmarks/bench_serve.py's machine).
    """
    server.app = app
    http = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="gaudi3-serve-http"
    )
    cancelled: list[int] = []
    hurry = threading.Event()
    stopper = threading.Thread(
        target=lambda: cancelled.append(_shut_down(server, app, hurry)), name="gaudi3-serve-stop"
    )

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stopper.ident is None:
            stopper.start()
        else:  # a second signal: do not wait for the requests in flight, nor for slow clients
            hurry.set()
            app.engine.hurry()

    http.start()  # before the handlers: shutdown() returns only once serve_forever has run
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        echo(ready_line)
        app.engine.run()
    finally:
        if stopper.ident is None:  # the loop ended without a signal (a bug): still close the server
            stopper.start()
        stopper.join()
        http.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    stats = app.engine.stats()
    echo(f"stopped after {stats.completed_requests} completions ({cancelled[0]} cancelled at shutdown)")


def _shut_down(server: CompletionServer, app: ServeApp, hurry: threading.Event) -> int:
    """Stop accepting, drain the engine (it then ends `run`), wait for the handlers until the grace ends (or
    `hurry` is set), end the connections left; the number cancelled."""
    deadline_s = time.monotonic() + DRAIN_GRACE_S
    server.shutdown()  # serve_forever returns: no connection is accepted any more
    app.engine.stop_accepting()  # so the backlog's requests get 503 shutting_down at once
    try:
        server.answer_backlog()  # closing the listener would reset the connections the kernel holds for us
    finally:  # whatever happened there, the listener closes and the drain goes on (the decode loop must end)
        server.socket.close()
        cancelled = app.engine.close(DRAIN_GRACE_S)
    while server.open_connections() and time.monotonic() < deadline_s and not hurry.wait(0.02):
        pass  # handlers still writing, or clients still sending their request
    answered_s = time.monotonic() + ANSWER_GRACE_S
    while server.open_connections() and time.monotonic() < answered_s:
        time.sleep(0.02)
    server.close_connections()  # a handler still reading or writing now fails at once
    server.server_close()  # joins the handler threads
    return cancelled
