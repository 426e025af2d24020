"""How the dashboard writes numbers: one place, used by the templates and sent to the page scripts as text.

Money goes through `cost.report.usd`, the formatter of `gaudi3 cost compare`, so both show the same strings.
Unknown values are "unknown" (the cost module's word) or "—" for a metric a run has not logged yet.
"""

from __future__ import annotations

import math
import time
from typing import Any

from gaudi3_scale.config.strict_json import non_finite_name
from gaudi3_scale.cost.report import UNKNOWN, usd

__all__ = [
    "UNKNOWN",
    "gib",
    "hours",
    "local_time",
    "loss",
    "overview_text",
    "percent",
    "ranks",
    "rate",
    "usd",
    "when",
]

MISSING = "—"


def gib(value: float | None) -> str:
    return MISSING if value is None else f"{value / 2**30:,.2f} GiB"


def _number(value: float | None, spec: str) -> str:
    """A metric as `format(value, spec)`; a diverged one (NaN, infinite) as the API and the charts spell it."""
    if value is None:
        return MISSING
    return format(value, spec) if math.isfinite(value) else non_finite_name(value)


def percent(value: float | None) -> str:
    return _number(value, ".2%")


def loss(value: float | None) -> str:
    return _number(value, ".4f")


def rate(value: float | None) -> str:
    return _number(value, ",.0f")


def hours(value: float | None) -> str:
    """Training time at the scale it is read: days, hours, minutes or seconds."""
    if value is None:
        return UNKNOWN
    if value >= 48:
        return f"{value / 24:,.1f} days"
    if value >= 1:
        return f"{value:,.1f} h"
    if value >= 1 / 60:
        return f"{value * 60:,.1f} min"
    return f"{value * 3600:.3g} s"


def local_time(unix_s: float | None) -> time.struct_time | None:
    """A Unix time as local time (the dashboard runs where its user is: `--host` defaults to loopback); None when
    unknown or out of range (a hand-edited or corrupt record's time)."""
    if unix_s is None:
        return None
    try:
        return time.localtime(unix_s)
    except (OverflowError, OSError, ValueError):  # NaN, infinite or beyond the platform's time_t
        return None


def when(unix_s: float | None) -> str:
    """A Unix time as local date and time."""
    moment = local_time(unix_s)
    return MISSING if moment is None else time.strftime("%Y-%m-%d %H:%M:%S", moment)


def ranks(value: list[int] | None) -> str:
    """Ranks named in a record: "rank 1", "ranks 1, 3", "none" (an empty list) or MISSING (unknown)."""
    if value is None:
        return MISSING
    if not value:
        return "none"
    return ("rank " if len(value) == 1 else "ranks ") + ", ".join(str(r) for r in value)


def overview_text(run: dict[str, Any]) -> dict[str, str]:
    """The formatted fields of `RunStore.overview`."""
    step = MISSING if run["step"] is None else f"{run['step']:,}"
    if run["max_steps"] is not None:
        step += f" / {run['max_steps']:,}"
    return {
        "step": step,
        "train_loss": loss(run["train_loss"]),
        "val_loss": loss(run["val_loss"]),
        "tokens_per_s": rate(run["tokens_per_s"]),
        "mfu": percent(run["mfu"]),
        "peak_memory": gib(run["peak_memory_bytes"]),
        "stragglers": ranks(run["stragglers"]),
        "cost": MISSING if run["cost_usd"] is None else usd(run["cost_usd"]),
        "updated": when(run["updated_unix"]),
    }
