"""Opt-in spot-interruption watcher: poll the instance-metadata service, stop gracefully when a notice appears.

AWS EC2 publishes `spot/instance-action` in the instance metadata about two minutes before it stops or terminates a
Spot Instance; the item is absent (HTTP 404) until then, and AWS recommends checking every 5 seconds (EC2 User
Guide, "Spot Instance interruption notices"). The notice is a JSON object such as
`{"action": "terminate", "time": "2017-09-18T08:22:00Z"}` (action: stop, terminate or hibernate). IMDSv2 needs a
session token first (`PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds`, then the token in
`X-aws-ec2-metadata-token`); when the token request fails the watcher polls without one (IMDSv1).

A notice is handed to `on_notice(text)` once; `GaudiTrainer` makes that the same graceful stop as SIGTERM (all ranks
agree, finish the step, checkpoint, exit 143 so launchers restart elsewhere). Only an answer in the notice's own
shape counts: exit 143 is restartable, so an unrelated HTTP 200 (a captive portal, a proxy page, an empty body) taken
for a notice would stop and restart the run in a loop. Such an answer, a token that cannot be sent and a service
that does not answer are each one warning (`warn`, once per distinct message), and watching goes on; a 404 is the
normal "no notice yet". Each request ends within `timeout_s` however slowly the service answers.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from urllib.parse import urlsplit

from gaudi3_scale.metering.price_http import open_bounded

__all__ = ["AWS_SPOT_URL", "NOTICE_ACTIONS", "SpotInterruptionWatcher", "parse_notice"]

AWS_SPOT_URL = "http://169.254.169.254/latest/meta-data/spot/instance-action"
NOTICE_ACTIONS = ("stop", "terminate", "hibernate")  # EC2 User Guide, "instance-action"
_TOKEN_PATH = "/latest/api/token"
_TOKEN_TTL_S = 21600
_TOKEN = re.compile(r"[\x21-\x7e]+")  # visible ASCII: what an HTTP header value can carry as it is
_MAX_ANSWER_BYTES = 64 * 1024  # a notice is ~60 bytes
_QUOTED_CHARS = 60

log = logging.getLogger(__name__)


def parse_notice(body: str) -> str | None:
    """Why `body` is not an interruption notice, or None when it is one (a JSON object with a known "action" and a
    "time" string)."""
    try:
        notice = json.loads(body)
    except ValueError:
        return "not JSON"
    if not isinstance(notice, dict):
        return f"a JSON {type(notice).__name__}, not an object"
    if notice.get("action") not in NOTICE_ACTIONS:
        return f'"action" is {notice.get("action")!r}, not one of {", ".join(NOTICE_ACTIONS)}'
    if not isinstance(notice.get("time"), str):
        return 'no "time" string'
    return None


def _quoted(text: str) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= _QUOTED_CHARS else text[:_QUOTED_CHARS] + "…")


class SpotInterruptionWatcher:
    """A daemon thread that polls `url` every `poll_s` seconds until a notice arrives or `stop()`."""

    def __init__(
        self,
        url: str,
        on_notice: Callable[[str], None],
        *,
        poll_s: float = 5.0,
        timeout_s: float = 2.0,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.url = url
        self.on_notice = on_notice
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.notice: str | None = None
        self.polls = 0
        self._warn = warn or log.warning
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gaudi3-spot-watcher", daemon=True)
        parts = urlsplit(url)
        self._where = f"spot watch ({parts.netloc})"  # never the whole URL: keep the log short
        self._token_url = f"{parts.scheme}://{parts.netloc}{_TOKEN_PATH}"
        self._token: str | None = None
        self._token_refused = False  # the service issued a token this watcher cannot send

    def start(self) -> SpotInterruptionWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s + 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            notice = self.poll()
            if notice is not None:
                self.notice = notice
                self.on_notice(notice)
                return
            self._stop.wait(self.poll_s)

    def poll(self) -> str | None:
        """One check: the notice's text, or None when there is none (or the answer is not a notice)."""
        self.polls += 1
        if self._token is None:
            self._token = self._fetch_token()
        headers = {"X-aws-ec2-metadata-token": self._token} if self._token else {}
        try:
            with open_bounded(
                urllib.request.Request(self.url, headers=headers), timeout_s=self.timeout_s
            ) as response:
                body = response.read(_MAX_ANSWER_BYTES).decode(errors="replace").strip()
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                self._token = None  # expired token: fetch a new one next time
                if not headers:
                    why = "the one it issues cannot be sent" if self._token_refused else "none could be had"
                    self._warn_once(
                        f"{self._where}: the metadata service wants a token (HTTP 401) and {why}; no interruption "
                        "notice can be seen (training continues, still trying)"
                    )
            return None
        except (OSError, ValueError) as exc:  # unreachable, timed out, refused: no notice seen this time
            self._warn_once(f"{self._where}: no answer ({type(exc).__name__}: {exc}); still polling")
            return None
        problem = parse_notice(body)
        if problem is None:
            return body
        self._warn_once(
            f"{self._where}: HTTP 200 that is not an interruption notice ({problem}: {_quoted(body)}); "
            "ignored, still polling"
        )
        return None

    def _fetch_token(self) -> str:
        """An IMDSv2 token, or '' to poll without one (no token service, or a token that cannot be sent)."""
        request = urllib.request.Request(
            self._token_url, method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": str(_TOKEN_TTL_S)}
        )
        try:
            with open_bounded(request, timeout_s=self.timeout_s) as response:
                token = response.read(_MAX_ANSWER_BYTES).decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""  # no IMDSv2 here: poll without a token
        if token and not _TOKEN.fullmatch(token):
            self._token_refused = True
            self._warn_once(
                f"{self._where}: the metadata token (PUT {_TOKEN_PATH}) cannot be sent as a header (it holds a "
                "space, a line break or a non-ASCII character; only visible ASCII can be sent); polling without one"
            )
            return ""
        return token

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            self._warn(message)
