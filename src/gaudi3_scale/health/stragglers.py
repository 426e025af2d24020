"""Straggler detection: which rank's own compute is slow, window after window, against the others'.

Every logging window, each rank's own compute time per step (`train.module`: its forward, before it can wait in
the gradient all-reduce) reaches every rank in the gather the window already does. A rank over the median of all
ranks by more than `threshold` (a fraction) is slow in that window; slow for `windows` windows in a row, it is
named a straggler until a window where it is not slow ends the episode. Every rank runs the same decision on the
same gathered numbers, so all ranks name the same stragglers without a further collective.

The median is over all ranks, the straggler's own time included: with 2 ranks it is their mean, so a threshold
of 0.2 names a rank only at 1.5× the other's time — on 2 ranks the decision is deliberately slow to accuse.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Straggler", "StragglerDetector"]


@dataclass(frozen=True)
class Straggler:
    """An episode: `rank` named at the window ending at `step`, its compute `ratio` × the median then."""

    rank: int
    step: int
    ratio: float
    windows: int

    def line(self) -> str:
        return (
            f"health: rank {self.rank} is a straggler: its own compute per step is {self.ratio:.1f}× the median "
            f"for {self.windows} windows (step {self.step})"
        )

    def record(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "ratio": self.ratio, "windows": self.windows}


class StragglerDetector:
    """`observe` each window's per-rank compute; `episodes` lists every straggler named, and `warn` is called
    once per episode, when the rank is named."""

    def __init__(self, *, threshold: float, windows: int, warn: Callable[[str], None]) -> None:
        assert threshold > 0 and windows > 0, "checked by HealthConfig"
        self.threshold, self.windows, self.warn = threshold, windows, warn
        self._streaks: list[int] = []  # slow windows in a row, by rank
        self.episodes: list[Straggler] = []

    def observe(self, step: int, compute_s_per_rank: Sequence[float]) -> list[int]:
        """The ranks named as stragglers after the window that ended at `step`."""
        if len(self._streaks) != len(compute_s_per_rank):  # the first window (or a new world size)
            self._streaks = [0] * len(compute_s_per_rank)
        median = statistics.median(compute_s_per_rank) if compute_s_per_rank else 0.0
        named = []
        for rank, seconds in enumerate(compute_s_per_rank):
            slow = median > 0 and seconds > median * (1 + self.threshold)
            self._streaks[rank] = self._streaks[rank] + 1 if slow else 0
            if self._streaks[rank] == self.windows:
                episode = Straggler(rank=rank, step=step, ratio=seconds / median, windows=self.windows)
                self.episodes.append(episode)
                self.warn(episode.line())
            if self._streaks[rank] >= self.windows:
                named.append(rank)
        return named
