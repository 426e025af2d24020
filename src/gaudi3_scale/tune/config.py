"""The tuner's own settings (the run it tunes is an ordinary RunConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from gaudi3_scale.config.core import check_positive, check_range
from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.config.numbers import INT32_MAX, INT64_MAX, check_number, check_seconds
from gaudi3_scale.tune.lr import LR_RULES, LrRule

__all__ = ["TuneConfig", "parse_bytes"]


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    world_size: int = 1
    memory_budget_bytes: int | None = None  # per rank; None = the device's memory × target_utilization
    target_utilization: float = 0.95  # fraction of device memory a chosen config may use
    time_budget_s: float | None = None  # stop starting trials after this; None = no limit
    min_gain: float = 0.02  # a further step of the search must be this much faster to continue
    dominated_below: float = 0.75  # stop exploring a group whose first trial is below this × best so far
    lr_rule: LrRule = "sqrt"
    prune_by_estimate: bool = True  # False: the estimate is reported but only trials decide what fits
    warmup_steps: int = 2
    measure_steps: int = 5
    trial_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name, low in (("world_size", 1), ("warmup_steps", 0), ("measure_steps", 1)):
            _check_count(name, getattr(self, name), low)
        if self.memory_budget_bytes is not None:
            _check_count("memory_budget_bytes", self.memory_budget_bytes, 1)
        check_number("world_size", self.world_size, low=1, high=INT32_MAX)
        check_positive("memory_budget_bytes", self.memory_budget_bytes)
        check_range("target_utilization", self.target_utilization, 0.05, 1.0)
        check_seconds("time_budget_s", self.time_budget_s)
        check_range("min_gain", self.min_gain, 0.0, 1.0)
        check_range("dominated_below", self.dominated_below, 0.0, 1.0)
        check_positive("warmup_steps", self.warmup_steps, allow_zero=True)
        check_positive("measure_steps", self.measure_steps)
        check_seconds("trial_timeout_s", self.trial_timeout_s)
        if self.lr_rule not in LR_RULES:
            raise UserInputError(f"--lr-rule must be one of {', '.join(LR_RULES)}, got {self.lr_rule!r}")


def _check_count(name: str, value: object, low: int) -> None:
    """A count is an int: 2.5 ranks or steps would pass the range checks and fail deep in a trial."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer >= {low}, got {brief(value)}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(text: str, *, flag: str = "--memory-budget") -> int:
    """'16GiB', '512MiB', '80GB', '1e9' → bytes; anything else is one line naming the flag."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise UserInputError(
            f"{flag}: cannot read {brief(text)}; give a size like 16GiB, 512MiB, 80GB or a number of bytes"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not 1 <= value <= INT64_MAX:  # 1e400 is inf; int(inf) would raise OverflowError
        raise UserInputError(f"{flag}: must be from 1 byte to 2**63 - 1 bytes, got {brief(text)}")
    return int(value)
