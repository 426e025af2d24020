"""Opt-in spot-interruption watcher: poll the instance-metadata service, stop gracefully when a notice appears.

AWS EC2 publishes `spot/instance-action` in the instance metadata about two minutes before it stops or terminates a
Spot Instance; the item is absent (HTTP 404) until then, and AWS recommends checking every 5 seconds (EC2 User
Guide, "Spot Instance interruption notices"). IMDSv2 needs a session token first (`PUT /latest/api/token` with
`X-aws-ec2-metadata-token-ttl-seconds`, then the token in `X-aws-ec2-metadata-token`); when the token request
fails the watcher polls without one (IMDSv1, or another provider's endpoint).

A notice (HTTP 200) is handed to `on_notice(text)` once; `GaudiTrainer` makes that the same graceful stop as
SIGTERM (all ranks agree, finish the step, checkpoint, exit 143 so launchers restart elsewhere). Any other
answer or a network error just means "no notice yet".
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from urllib.parse import urlsplit

__all__ = ["AWS_SPOT_URL", "SpotInterruptionWatcher"]

AWS_SPOT_URL = "http://169.254.169.254/latest/meta-data/spot/instance-action"
_TOKEN_PATH = "/latest/api/token"
_TOKEN_TTL_S = 21600


class SpotInterruptionWatcher:
    """A daemon thread that polls `url` every `poll_s` seconds until a notice arrives or `stop()`."""

    def __init__(
        self, url: str, on_notice: Callable[[str], None], *, poll_s: float = 5.0, timeout_s: float = 2.0
    ) -> None:
        self.url = url
        self.on_notice = on_notice
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.notice: str | None = None
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gaudi3-spot-watcher", daemon=True)
        parts = urlsplit(url)
        self._token_url = f"{parts.scheme}://{parts.netloc}{_TOKEN_PATH}"
        self._token: str | None = None

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
        """One check: the notice's text, or None when there is none (or the service does not answer)."""
        self.polls += 1
        if self._token is None:
            self._token = self._fetch_token()
        headers = {"X-aws-ec2-metadata-token": self._token} if self._token else {}
        try:
            with urllib.request.urlopen(
                urllib.request.Request(self.url, headers=headers), timeout=self.timeout_s
            ) as response:
                return response.read().decode(errors="replace").strip() or "(empty notice)"
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                self._token = None  # expired token: fetch a new one next time
            return None
        except (OSError, ValueError):
            return None

    def _fetch_token(self) -> str:
        request = urllib.request.Request(
            self._token_url, method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": str(_TOKEN_TTL_S)}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read().decode().strip()
        except (OSError, ValueError):
            return ""  # no IMDSv2 here: poll without a token
