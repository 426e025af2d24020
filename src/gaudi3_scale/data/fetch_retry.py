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
        """`attempt()`, retried on transient errors until the outage has lasted `budget_s`, then one
        `UserInputError` line naming `what` (a URL), how long it retried and `budget_name` (what sets the budget).

        The outage is this Retrier's, shared by its threads: it begins at the first failure and ends at the next
        success of any call. So a call that starts while another has been failing for a while (the prefetch thread
        retrying the shard `shard_path` now waits for) gets only what is left of the budget, not a fresh one.
        """
        delay_s = self.first_backoff_s
        while True:
            try:
                result = attempt()
            except Exception as error:
                if not is_transient_error(error):
                    raise
                elapsed_s = self._failed(what, error, budget_s, budget_name)
                if elapsed_s >= budget_s:
                    raise UserInputError(
                        f"{what}: unreachable, retried for {elapsed_s:.1f} s ({budget_name}={budget_s:g}); "
                        f"last error {_describe(error)}"
                    ) from error
                with self._lock:
                    self.retries += 1
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

    def _failed(self, what: str, error: Exception, budget_s: float, budget_name: str) -> float:
        """Seconds since the outage began (this failure begins one when none is under way)."""
        now_s = time.monotonic()
        with self._lock:
            began = self._outage_since_s is None
            if began:
                self._outage_since_s = now_s
            since_s = self._outage_since_s
        assert since_s is not None
        if began:
            log.warning(
                "%s: %s; retrying with backoff for up to %g s (%s)",
                what,
                _describe(error),
                budget_s,
                budget_name,
            )
        return now_s - since_s

    def _succeeded(self, what: str) -> None:
        with self._lock:
            since_s, self._outage_since_s = self._outage_since_s, None
        if since_s is not None:
            log.warning("%s: storage reachable again after %.1f s", what, time.monotonic() - since_s)


def _describe(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__
