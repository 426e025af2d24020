"""One JSON GET for the public price APIs (Azure Retail Prices, GCP Cloud Billing Catalog), with the standard library.

Every failure is one `SpotPriceError` line that names what was asked (`where`): an HTTP status (with the API's own
error message when it sends one), a refused connection, a timeout, a body that is not a JSON object. Redirects are
refused rather than followed: urllib would resend our headers (an API key) to wherever a 3xx points. The URL is
never part of a message, so a key in it could not leak either (we send keys in headers anyway).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from gaudi3_scale.metering.quotes import SpotPriceError

__all__ = ["MAX_PAGES", "get_json", "same_origin"]

MAX_PAGES = 50  # pages followed per quote: a GCP Compute Engine catalog is a few pages of 5,000 SKUs
_MAX_BODY_BYTES = 64 * 1024 * 1024  # one page; a page of 5,000 SKUs is a few MB
_QUOTED_CHARS = 160  # of an API's error message


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises HTTPError with the 3xx status


_OPENER = urllib.request.build_opener(_RefuseRedirects())


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
    """GET `url` and parse a JSON object; `timeout_s` bounds the connection and each read."""
    request = urllib.request.Request(
        url, headers={"Accept": "application/json", "User-Agent": "gaudi3-scale", **(headers or {})}
    )
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
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
