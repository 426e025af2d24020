"""How long a repeated pause took (a checkpoint save stopping training), kept in bounded memory whatever the run's
length: the count, total, longest and latest, and the most recent few. A list of every duration grew by one entry
per save into summary.json (a soak of 6,000 saves: 135 kB of its 174 kB); a run of a million steps that saves every
20 makes 50,000."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

__all__ = ["Durations"]


class Durations:
    """Durations in seconds, added by one thread (`add`) and read by others (a Prometheus scrape): `count`,
    `total_s`, `max_s`, `last_s` and `recent_s` (the newest `keep`)."""

    def __init__(self, keep: int = 64) -> None:
        self.count = 0
        self.total_s = 0.0
        self.max_s: float | None = None
        self.last_s: float | None = None
        self._recent: deque[float] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.count += 1
            self.total_s += seconds
            self.max_s = seconds if self.max_s is None else max(self.max_s, seconds)
            self.last_s = seconds
            self._recent.append(seconds)

    def snapshot(self) -> tuple[int, float | None]:
        """(count, the latest duration), read together."""
        with self._lock:
            return self.count, self.last_s

    @property
    def recent_s(self) -> list[float]:
        with self._lock:
            return list(self._recent)

    def summary(self, prefix: str) -> dict[str, Any]:
        """summary.json's fields for these durations: `<prefix>_s` the most recent (oldest first), `<prefix>_count`,
        `<prefix>_total_s` and `<prefix>_max_s`."""
        with self._lock:
            return {
                f"{prefix}_s": list(self._recent),
                f"{prefix}_count": self.count,
                f"{prefix}_total_s": self.total_s,
                f"{prefix}_max_s": self.max_s,
            }
