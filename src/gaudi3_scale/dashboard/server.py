"""Serving the dashboard: werkzeug's threaded WSGI server, a URL to open, and a clean stop on Ctrl-C."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.dashboard.app import create_app
from gaudi3_scale.dashboard.security import TOKEN_ENV, is_loopback, new_token, token_problem

__all__ = ["build_server", "dashboard_url", "resolve_token", "serve"]


def resolve_token(host: str, token: str | None) -> tuple[str | None, bool]:
    """(the token to require, whether it was generated): off loopback one is always required; one given must be
    strong enough (`security.token_problem`), else one line naming the option."""
    if token is not None:
        problem = token_problem(token)
        if problem is not None:
            raise UserInputError(f"--token (or {TOKEN_ENV}): {problem}")
        return token, False
    if is_loopback(host):
        return None, False
    return new_token(), True


def dashboard_url(host: str, port: int, token: str | None) -> str:
    """The URL to open, with `token` in it when one is passed: the CLI passes a generated one (shown once, as
    Jupyter does), never one the user chose (stdout often ends up in a log)."""
    shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}/" + (f"?token={quote(token, safe='')}" if token else "")


def _quiet_handler() -> type:
    """werkzeug's request handler, logging only refused and failed requests (the live view polls every second)."""
    from werkzeug.serving import WSGIRequestHandler

    class QuietHandler(WSGIRequestHandler):
        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            try:
                status = int(code)  # an int, an HTTPStatus or "-"
            except ValueError:
                status = 0
            if 0 < status < 400:
                return
            super().log_request(code, size)

    return QuietHandler


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket; bound here rather than by werkzeug, whose bind failure prints and exits 1."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # werkzeug's select_address_family
    try:
        address = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    except socket.gaierror as exc:
        raise UserInputError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        reason = exc.strerror or exc
        raise UserInputError(f"--host {host} --port {port}: cannot listen there ({reason})") from None
    return sock


def build_server(runs_dir: Path, host: str, port: int, token: str | None) -> Any:
    """A threaded werkzeug server for the dashboard (not yet serving); `.port` is the bound port."""
    from werkzeug.serving import make_server

    app = create_app(runs_dir, host=host, token=token)
    with _listen(host, port) as sock:  # werkzeug serves a duplicate of it
        return make_server(host, port, app, threaded=True, request_handler=_quiet_handler(), fd=sock.fileno())


def _warm_imports() -> None:
    """Import torch and the cost estimator while nobody waits, not on the first checkpoints or cost view."""
    import gaudi3_scale.checkpoint.manager
    import gaudi3_scale.cost.estimate
    import gaudi3_scale.models.counting  # noqa: F401


def serve(server: Any, echo: Callable[[str], None]) -> None:
    """Serve until Ctrl-C (werkzeug's serve_forever returns on it and closes the socket)."""
    threading.Thread(target=_warm_imports, name="gaudi3-dashboard-warm", daemon=True).start()
    try:
        server.serve_forever()
    finally:
        server.server_close()
    echo("dashboard stopped")
