"""Retrying reads from object storage: transient errors back off exponentially until a time budget is spent.

Transient means what `gaudi3_scale.storage.is_transient_error` says (refused / reset / timed-out connections, 5xx,
throttling); anything else, a missing object included, is raised at once. One warning when an outage begins and one
when it ends, however many threads retry through it. The backoff jitter comes from a generator of our own: the
global `random` state is part of what checkpoints record, and a run with an outage must stay bitwise identical to
one without.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.storage import is_transient_error

__all__ = ["FetchStopped", "Retrier"]

T = TypeVar("T")
log = logging.getLogger(__name__)


class FetchStopped(Exception):
    """The owner is closing: the retrying (or the download) was abandoned."""


class Retrier:
    """Runs storage reads with retries; `retries` counts the failed attempts that were tried again."""

    def __init__(self, *, first_backoff_s: float = 0.5, max_backoff_s: float = 10.0) -> None:
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.retries = 0
        self._lock = threading.Lock()
        self._outage_since_s: float | None = None
        self._jitter = random.Random()  # seeded from the OS; never the global generator

    def call(
        self,
        what: str,
        attempt: Callable[[], T],
        *,
        budget_s: float,
        budget_name: str,
        stop: threading.Event | None = None,
    ) -> T:
        """`attempt()`, retried on transient errors for up to `budget_s` after the first failure; then one
        `UserInputError` line naming `what` (a URL), how long it retried and `budget_name` (what sets the budget)."""
        first_failure_s: float | None = None
        delay_s = self.first_backoff_s
        while True:
            try:
                result = attempt()
            except Exception as error:
                if not is_transient_error(error):
                    raise
                now_s = time.monotonic()
                first_failure_s = now_s if first_failure_s is None else first_failure_s
                elapsed_s = now_s - first_failure_s
                if elapsed_s >= budget_s:
                    raise UserInputError(
                        f"{what}: unreachable, retried for {elapsed_s:.1f} s ({budget_name}={budget_s:g}); "
                        f"last error {_describe(error)}"
                    ) from error
                self._failed(what, error, budget_s, budget_name)
                wait_s = min(
                    delay_s * (0.5 + self._jitter.random()), self.max_backoff_s, budget_s - elapsed_s
                )
                if stop is None:
                    time.sleep(wait_s)
                elif stop.wait(wait_s):
                    raise FetchStopped(what) from error
                delay_s = min(2 * delay_s, self.max_backoff_s)
            else:
                self._succeeded(what)
                return result

    def _failed(self, what: str, error: Exception, budget_s: float, budget_name: str) -> None:
        with self._lock:
            self.retries += 1
            if self._outage_since_s is not None:
                return
            self._outage_since_s = time.monotonic()
        log.warning(
            "%s: %s; retrying with backoff for up to %g s (%s)", what, _describe(error), budget_s, budget_name
        )

    def _succeeded(self, what: str) -> None:
        with self._lock:
            since_s, self._outage_since_s = self._outage_since_s, None
        if since_s is not None:
            log.warning("%s: storage reachable again after %.1f s", what, time.monotonic() - since_s)


def _describe(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__
