"""Loss-spike detection: a value over the running median + k × MAD of the last steps (a robust statistic: one
earlier spike moves neither). Pure Python on host floats; its history is checkpointed, so a resumed run decides as
an uninterrupted one would."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Spike", "SpikeDetector"]

# The MAD of a flat history is 0, and any change would be "infinitely many MADs" away: the spread has a floor of
# this fraction of the median's magnitude.
_MIN_SPREAD_OF_MEDIAN = 1e-3


@dataclass(frozen=True)
class Spike:
    value: float
    median: float
    mad: float
    threshold: float

    def describe(self, what: str) -> str:
        return (
            f"{what} {self.value:.4g} is over the running median {self.median:.4g} + "
            f"{(self.threshold - self.median) / self.mad:.3g} × MAD {self.mad:.3g} = {self.threshold:.4g}"
        )


class SpikeDetector:
    """`check(value)`: a `Spike` when `value` is over median + `threshold_mads` × MAD of the last `window` values
    (looked for once `warmup` values are held); values that are not spikes join the history."""

    def __init__(self, *, window: int, warmup: int, threshold_mads: float) -> None:
        self.window, self.warmup, self.threshold_mads = window, warmup, threshold_mads
        self.history: deque[float] = deque(maxlen=window)

    def check(self, value: float) -> Spike | None:
        if len(self.history) >= self.warmup:
            median = statistics.median(self.history)
            mad = statistics.median(abs(v - median) for v in self.history)
            mad = max(mad, abs(median) * _MIN_SPREAD_OF_MEDIAN, 1e-12)
            threshold = median + self.threshold_mads * mad
            if value > threshold:
                return Spike(value, median, mad, threshold)
        self.history.append(value)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = deque((float(v) for v in state.get("history", [])), maxlen=self.window)
