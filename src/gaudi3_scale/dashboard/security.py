"""Who may read the dashboard: loopback by default, a token everywhere else, and nothing but GET and HEAD.

* **Token.** Bound to any address that is not loopback, every request needs the token (`--token`, or
  `GAUDI3_DASHBOARD_TOKEN`, or one generated and printed with the URL, as Jupyter does). It is accepted as
  `Authorization: Bearer <token>`, as the HttpOnly SameSite=Strict cookie, or as `?token=<token>`: on a page
  that sets the cookie and redirects to the same page without it (so the token leaves the address bar and
  history, and the page's own API calls carry the cookie); on /api/… it is simply accepted (curl, scripts).
  Compared in constant time.
* **Loopback without a token** still checks the Host header: a page on another site that rebinds its DNS name
  to 127.0.0.1 sends its own name, and is refused (DNS rebinding).
* **Read-only.** Only GET and HEAD are served; any other method is 405 before anything else runs.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from typing import TYPE_CHECKING
from urllib.parse import urlencode

if TYPE_CHECKING:
    from flask import Flask, Response
    from werkzeug.wrappers import Response as ResponseBase

__all__ = ["COOKIE_NAME", "TOKEN_ENV", "install_guards", "is_loopback", "new_token"]

TOKEN_ENV = "GAUDI3_DASHBOARD_TOKEN"
COOKIE_NAME = "gaudi3_dashboard_token"
ALLOWED_METHODS = ("GET", "HEAD")
_LOOPBACK_NAMES = ("localhost", "localhost.")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost (a name that resolves elsewhere is not loopback)."""
    host = host.strip().strip("[]")
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    return secrets.token_urlsafe(24)  # 192 bits


def _host_name(host_header: str) -> str:
    """The name in a Host header: 127.0.0.1:8080 → 127.0.0.1, [::1]:8080 → ::1."""
    if host_header.startswith("["):
        return host_header[1 : host_header.find("]")] if "]" in host_header else host_header
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def _refuse(status: int, message: str) -> Response:
    from flask import jsonify, request

    response = jsonify(error=message) if request.path.startswith("/api/") else _text(message)
    response.status_code = status
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="gaudi3 dashboard"'
    if status == 405:
        response.headers["Allow"] = ", ".join(ALLOWED_METHODS)
    return response


def _text(message: str) -> Response:
    from flask import make_response

    response = make_response(message + "\n")
    response.mimetype = "text/plain"
    return response


def _presented_token() -> tuple[str | None, bool]:
    """(the token the request carries, whether it came in the query string)."""
    from flask import request

    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip(), False
    if "token" in request.args:
        return request.args["token"], True
    return request.cookies.get(COOKIE_NAME), False


def install_guards(app: Flask, token: str | None) -> None:
    """Method, Host and token checks before every request; security headers after."""
    from flask import redirect, request

    @app.before_request
    def _guard() -> ResponseBase | None:
        if request.method not in ALLOWED_METHODS:
            return _refuse(405, f"{request.method} not allowed: the dashboard is read-only (GET, HEAD)")
        if token is None:
            if not is_loopback(_host_name(request.host)):
                return _refuse(403, f"Host {request.host!r} refused: this dashboard serves loopback only")
            return None
        presented, in_query = _presented_token()
        if presented is None or not hmac.compare_digest(presented.encode(), token.encode()):
            return _refuse(401, "this dashboard needs its token: open the URL `gaudi3 dashboard` printed "
                           "(…/?token=…) or send 'Authorization: Bearer <token>'")  # fmt: skip
        if in_query and not request.path.startswith("/api/"):  # a page: move the token into a cookie
            rest = [(k, v) for k, v in request.args.items(multi=True) if k != "token"]
            target = request.path + (f"?{urlencode(rest)}" if rest else "")
            response = redirect(target, code=303)
            response.set_cookie(COOKIE_NAME, token, httponly=True, samesite="Strict", path="/")
            return response
        return None

    @app.after_request
    def _headers(response: Response) -> Response:
        response.headers.setdefault(
            "Content-Security-Policy",
            "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
            "frame-ancestors 'self'; form-action 'none'; base-uri 'none'",
        )
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        return response
