"""A bounded summary of a long metrics.jsonl's charts: what the live page draws of the lines it is not sent whole.

A run of a million steps must not cost the dashboard a million records in memory, nor its first poll a 400 MB
response (the page draws at most `charts.js`'s MAX_DRAWN points per series anyway). The lines are grouped in
buckets of consecutive lines; each bucket keeps, per charted metric, its first record and the records of its
lowest and highest value, its first non-finite value (a diverged loss: the chart's gap), and its first record of
each health-mark kind (`health.marks`). So a one-step loss spike stays visible however long the run. When there
are more than `MAX_BUCKETS` buckets, neighbours merge (a bucket then spans twice the lines).

A kept record is the chart's part of the line (`step`, `wall_s` and the charted metrics), except a health event,
kept whole for its mark.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gaudi3_scale.health.marks import event_mark

__all__ = ["CHARTED", "MAX_BUCKETS", "Downsampled"]

CHARTED = ("train_loss", "val_loss", "tokens_per_s", "mfu", "cost_usd")  # what the live page's charts draw
MAX_BUCKETS = (
    512  # about 2 × 512 points per metric: above the 1,500 the page draws, so nothing is lost to the eye
)
_AXES = ("step", "wall_s")  # the charts' x (and the progress chart's y)

# role -> (line, value, record); a role is "first", "min:KEY", "max:KEY", "gap:KEY" or "mark:KIND"
_Kept = dict[str, tuple[int, float, dict[str, Any]]]


def _better(role: str, old: tuple[int, float, Any], new: tuple[int, float, Any]) -> bool:
    """Whether `new` should take `old`'s place in a bucket: the lower for a min, the higher for a max, else the
    earlier line."""
    if role.startswith("min:"):
        return new[1] < old[1]
    if role.startswith("max:"):
        return new[1] > old[1]
    return new[0] < old[0]


def _merge(kept: _Kept, role: str, entry: tuple[int, float, dict[str, Any]]) -> None:
    old = kept.get(role)
    if old is None or _better(role, old, entry):
        kept[role] = entry


@dataclass
class Downsampled:
    """The kept records of lines 0 … n - 1 of one file, fed in line order (`add`)."""

    width_lines: int = 1  # lines per bucket
    _buckets: dict[int, _Kept] = field(
        default_factory=dict
    )  # bucket index -> its kept records, in line order
    _records: tuple[dict[str, Any], ...] | None = None  # `records()`, until the next add

    def add(self, line: int, record: dict[str, Any]) -> None:
        """Line `line` holds `record` (lines that are not records are simply never added)."""
        self._records = None
        kept = self._buckets.setdefault(line // self.width_lines, {})
        chart = {k: record[k] for k in (*_AXES, *CHARTED) if k in record}
        _merge(kept, "first", (line, 0.0, chart))
        for key in CHARTED:
            value = record.get(key)
            if value is None:
                continue
            if math.isfinite(value):
                _merge(kept, "min:" + key, (line, value, chart))
                _merge(kept, "max:" + key, (line, value, chart))
            else:
                _merge(kept, "gap:" + key, (line, 0.0, chart))
        mark = event_mark(record)
        if mark is not None:
            _merge(kept, "mark:" + mark, (line, 0.0, record))
        if len(self._buckets) > MAX_BUCKETS:
            self._halve()

    def _halve(self) -> None:
        """Merge each pair of neighbouring buckets: twice the lines per bucket, at most half the buckets."""
        merged: dict[int, _Kept] = {}
        for index, kept in self._buckets.items():
            into = merged.setdefault(index // 2, {})
            for role, entry in kept.items():
                _merge(into, role, entry)
        self._buckets = merged
        self.width_lines *= 2

    def records(self) -> tuple[dict[str, Any], ...]:
        """The kept records in line order, each once (a health event whole, the others their chart part)."""
        if self._records is None:
            by_line: dict[int, dict[str, Any]] = {}
            for kept in self._buckets.values():
                for role, (line, _, record) in kept.items():
                    if role.startswith("mark:") or line not in by_line:
                        by_line[line] = record
            self._records = tuple(by_line[line] for line in sorted(by_line))
        return self._records
