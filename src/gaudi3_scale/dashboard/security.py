"""Who may read the dashboard: loopback by default, a token everywhere else, and nothing but GET and HEAD.

* **Token.** Bound to any address that is not loopback, every request needs the token (`--token`, or
  `GAUDI3_DASHBOARD_TOKEN`, or one generated and printed with the URL, as Jupyter does). It is accepted as
  `Authorization: Bearer <token>`, as the HttpOnly SameSite=Strict cookie, or as `?token=<token>`: on a page
  that sets the cookie and redirects to the same page without it (so the token leaves the address bar and
  history, and the page's own API calls carry the cookie); on /api/… it is simply accepted (curl, scripts).
  Compared in constant time. A token given (rather than generated) must be at least 16 characters of printable
  ASCII without spaces, `"`, `,`, `;` or `\\` (it travels in a cookie): `token_problem` says what is wrong.
* **Logs never hold a token.** Every log line of the server and the app goes through `redact`: the value of any
  `token` query parameter (however its name is percent-encoded) and the dashboard's own tokens become
  `[redacted]`, so a refused `?token=…` request is logged without it.
* **Loopback without a token** still checks the Host header: a page on another site that rebinds its DNS name
  to 127.0.0.1 sends its own name, and is refused (DNS rebinding).
* **Read-only.** Only GET and HEAD are served; any other method is 405 before anything else runs.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
import secrets
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote_plus, urlencode

if TYPE_CHECKING:
    from flask import Flask, Response
    from werkzeug.wrappers import Response as ResponseBase

__all__ = [
    "COOKIE_NAME",
    "MIN_TOKEN_CHARS",
    "TOKEN_ENV",
    "install_guards",
    "is_loopback",
    "new_token",
    "redact",
    "token_problem",
]

TOKEN_ENV = "GAUDI3_DASHBOARD_TOKEN"
COOKIE_NAME = "gaudi3_dashboard_token"
ALLOWED_METHODS = ("GET", "HEAD")
_LOOPBACK_NAMES = ("localhost", "localhost.")
# 16 characters of a random URL-safe token are 96 bits; a person's choice of 16 is weaker, but no longer guessable
# by trying one character at a time over HTTP. Generated tokens are 32 characters (`new_token`).
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 1024
_COOKIE_UNSAFE = set('",;\\')  # RFC 6265 cookie-octet excludes these (and spaces, and controls)
REDACTED = "[redacted]"
_QUERY_PARAM = re.compile(r"([?&;])([^=&;\s\"'#]*)=([^&;\s\"'#]*)")


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


def token_problem(token: str) -> str | None:
    """Why `token` cannot guard the dashboard, in a few words; None when it can."""
    if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
        return (f"{len(token)} characters; a token needs {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} "
                "(leave it out off loopback and one is generated)")  # fmt: skip
    bad = next((c for c in token if not "!" <= c <= "~" or c in _COOKIE_UNSAFE), None)
    if bad is not None:
        return (f"character {bad!r} is not allowed; use printable ASCII without spaces, quotes, commas, "
                "semicolons or backslashes")  # fmt: skip
    return None


def redact(text: str, tokens: set[str] | frozenset[str] = frozenset()) -> str:
    """`text` without secrets: every `token` query parameter's value, and each of `tokens` wherever it appears."""

    def param(match: re.Match[str]) -> str:
        sep, key, value = match.groups()
        if unquote_plus(key).strip().lower() == "token" and value:
            return f"{sep}{key}={REDACTED}"
        return match.group(0)

    for token in tokens:
        text = text.replace(token, REDACTED).replace(quote(token, safe=""), REDACTED)
    return _QUERY_PARAM.sub(param, text)


class _RedactFilter(logging.Filter):
    """Rewrites every record of the logger it is on with `redact` (the tokens of every app made here)."""

    def __init__(self) -> None:
        super().__init__("gaudi3-dashboard-redact")
        self.tokens: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message, self.tokens)
        if clean != message:
            record.msg, record.args = clean, None
        return True


_REDACT = _RedactFilter()


def _install_redaction(app: Flask, token: str | None) -> None:
    """On werkzeug's logger (access lines, request errors) and the app's (its exceptions), once each."""
    if token is not None:
        _REDACT.tokens.add(token)
    for logger in (logging.getLogger("werkzeug"), app.logger):
        if _REDACT not in logger.filters:
            logger.addFilter(_REDACT)


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
    """Method, Host and token checks before every request; security headers after; logs without tokens."""
    from flask import redirect, request

    _install_redaction(app, token)

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
