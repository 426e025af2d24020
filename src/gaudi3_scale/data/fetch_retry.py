"""Retrying reads from object storage: transient errors back off exponentially until a time budget is spent.

Transient means what `gaudi3_scale.storage.is_transient_error` says, the rule the checkpoint mirror follows too
(refused / reset / timed-out connections, throttling, HTTP 5xx, 408 or 429, read through fsspec's http wrapping of
them in `FileNotFoundError`); anything else, a missing object (HTTP 404) or a refused one (403) included, is raised at
once. A read that stalls is bounded by the backend's timeouts (`stall_timeout_s`, passed to the store by
`data.remote`) and counts as a failure; the outage it begins is dated back to when the store last answered: the
failing attempt's start, or the last bytes it delivered (`heard_from_store`), so a stalled first attempt is charged
to the budget in full, however many waits it held, and a long transfer cut off at its end is not. One warning when an
outage begins and one when it ends, however many threads retry through it; none from a caller that is stopping. The
backoff jitter comes from a generator of our own: the global `random` state is part of what checkpoints record, and
a run with an outage must stay bitwise identical to one without.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.storage import http_status, is_transient_error

__all__ = [
    "FetchStopped",
    "Retrier",
    "describe_error",
    "http_status",  # re-exported: `data.remote` reads a status as `describe_error` does
    "stall_timeout_s",
]

T = TypeVar("T")
log = logging.getLogger(__name__)
# Longest wait for a connection or for the next bytes of a read (s3fs's own default read timeout); a budget of
# data.fetch_retry_s spends at most a quarter of itself on one stalled attempt, and a stall is at least 1 s.
MAX_STALL_S = 15.0
MIN_STALL_S = 1.0


def stall_timeout_s(budget_s: float) -> float:
    """How long a read of a retry budget of `budget_s` waits for a connection or the next bytes before failing."""
    return min(MAX_STALL_S, max(MIN_STALL_S, budget_s / 4))


class FetchStopped(Exception):
    """The owner is closing: the retrying (or the download) was abandoned."""


class Retrier:
    """Runs storage reads with retries; `retries` counts the failed attempts that were tried again."""

    def __init__(
        self,
        *,
        first_backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        quiet: bool = False,
    ) -> None:
        """`quiet`: log outages at debug level only (a caller whose budget is a few seconds: its error line says
        it all)."""
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self._level = logging.DEBUG if quiet else logging.WARNING
        self.retries = 0
        self._lock = threading.Lock()
        self._outage_since_s: float | None = None
        self._attempt = threading.local()  # answered_s: when the store last answered this thread's attempt
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
            self._attempt.answered_s = time.monotonic()
            try:
                result = attempt()
            except Exception as error:
                if not is_transient_error(error):
                    raise
                elapsed_s = self._failed(what, error, budget_s, budget_name, stop)
                if elapsed_s >= budget_s:
                    raise UserInputError(
                        f"{what}: unreachable, retried for {elapsed_s:.1f} s ({budget_name}={budget_s:g}); "
                        f"last error {describe_error(error)}"
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
                self._succeeded(what, stop)
                return result

    def heard_from_store(self) -> None:
        """Called by an attempt when bytes arrive: should it fail later, its outage began then, not at its start."""
        self._attempt.answered_s = time.monotonic()

    def _failed(
        self,
        what: str,
        error: Exception,
        budget_s: float,
        budget_name: str,
        stop: threading.Event | None,
    ) -> float:
        """Seconds since the outage began (this failure begins one when none is under way: when the store last
        answered this attempt, its start when nothing came; an attempt may hold several waits, fsspec's http `open`
        a HEAD and then the GET, and a stalled one waits for each)."""
        now_s = time.monotonic()
        with self._lock:
            began = self._outage_since_s is None
            if began:
                self._outage_since_s = self._attempt.answered_s
            since_s = self._outage_since_s
        assert since_s is not None
        if began and not (stop is not None and stop.is_set()):
            log.log(
                self._level,
                "%s: %s; retrying with backoff for up to %g s (%s)",
                what,
                describe_error(error),
                budget_s,
                budget_name,
            )
        return now_s - since_s

    def _succeeded(self, what: str, stop: threading.Event | None) -> None:
        with self._lock:
            since_s, self._outage_since_s = self._outage_since_s, None
        if since_s is not None and not (stop is not None and stop.is_set()):
            log.log(self._level, "%s: storage reachable again after %.1f s", what, time.monotonic() - since_s)


def describe_error(error: BaseException) -> str:
    """A storage error in a few words: `HTTP 503 Service Unavailable` for an HTTP status, else its type and text."""
    if (status := http_status(error)) is not None:
        cause = error if getattr(error, "status", None) == status else error.__cause__
        reason = getattr(cause, "message", "")
        return f"HTTP {status} {reason}".strip() if isinstance(reason, str) else f"HTTP {status}"
    if isinstance(error, FileNotFoundError) and error.__cause__ is not None:  # fsspec http's wrapping
        error = error.__cause__
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__
