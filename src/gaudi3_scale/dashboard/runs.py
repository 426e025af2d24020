"""What the dashboard reads from `--runs DIR`: its direct child directories and a training run's files.

A child directory is a **run** (it holds `config.yaml`, `metrics.jsonl` or `summary.json`, as `gaudi3 train`
leaves them) or a **benchmark** result set (`matrix.yaml` + `cells/` from `gaudi3 benchmark run`, or a
`report/report.html` from `gaudi3 benchmark report`). A name from a URL is only ever looked up among the entries
`os.scandir` lists (symlinks are not followed), so `..`, `/`, absolute paths and links out of DIR name nothing;
every file inside a run is reached through `files` (a symlink out of the runs directory is never read).

`metrics.jsonl` is read incrementally: each file's complete lines are parsed once and kept, and a poll reads only
the bytes appended since. A line that is not a JSON object is counted as unreadable, never fatal.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gaudi3_scale.config.core import load_yaml
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.config.files import load_json_file
from gaudi3_scale.config.numbers import finite_number, is_number
from gaudi3_scale.config.strict_json import restore_non_finite
from gaudi3_scale.dashboard.files import OutsideRuns, has_file, real_file
from gaudi3_scale.train.forecast_file import PLAN_FILE

__all__ = ["MetricsReader", "MetricsView", "RunStore", "child_kind", "config_section"]

RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json")
STALE_S = 60.0  # no summary and no metrics written for this long: the run is not training any more
PARTIAL_GRACE_S = 10.0  # a last line without "\n" this old is a truncated write, not one being written


def child_kind(root: Path, directory: Path) -> str | None:
    """The kind of a child of the runs directory `root`: "run", "benchmark", or None for neither."""
    if has_file(root, directory / "matrix.yaml") and (directory / "cells").is_dir():
        return "benchmark"
    if has_file(root, directory / "report" / "report.html") or has_file(root, directory / "report.html"):
        return "benchmark"
    if any(has_file(root, directory / name) for name in RUN_FILES):
        return "run"
    return None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def config_section(config: dict[str, Any], key: str) -> dict[str, Any]:
    """One section of a run's config.yaml; {} when absent or not a mapping (a hand-edited file)."""
    value = config.get(key)
    return value if isinstance(value, dict) else {}


# What the pages and the API read from a record as numbers (a diverged loss may be NaN or infinite; a count not).
_COUNTS = ("step", "tokens_seen", "peak_memory_bytes")
_NUMBERS = ("train_loss", "val_loss", "tokens_per_s", "mfu", "wall_s", "step_time_s",
            "time_unix", "cost_usd", "cost_usd_per_hour", "cost_projected_usd", "cost_budget_usd",
            "cost_budget_remaining_usd", "projected_finish_unix", "scaling_efficiency")  # fmt: skip


def _misfit(record: dict[str, Any]) -> bool:
    """Whether a metrics record holds a field of another type than `gaudi3 train` writes there."""
    counts = [finite_number(record[k]) for k in _COUNTS if record.get(k) is not None]
    if not all(v is not None and v >= 0 for v in counts):
        return True
    if any(record.get(k) is not None and not is_number(record[k]) for k in _NUMBERS):
        return True
    stragglers = record.get("stragglers")
    return stragglers is not None and not (
        isinstance(stragglers, list)
        and all(isinstance(r, int) and not isinstance(r, bool) for r in stragglers)
    )


@dataclass
class _Tail:
    """Everything parsed so far from one metrics.jsonl (one entry per complete line; None: blank or unreadable)."""

    inode: int
    offset: int = 0  # bytes consumed: always the end of a complete line
    lines: list[dict[str, Any] | None] = field(default_factory=list)
    unreadable: int = 0
    partial: bool = False  # bytes after the last "\n"
    mtime: float = 0.0
    latest_train: dict[str, Any] | None = None
    latest_val: dict[str, Any] | None = None
    latest_cost: dict[str, Any] | None = None
    peak_memory_bytes: int | None = None

    def add(self, raw: bytes) -> None:
        if not raw.strip():
            self.lines.append(None)
            return
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):  # also UnicodeDecodeError; absurd nesting
            record = None
        if not isinstance(record, dict):
            self.unreadable += 1
            self.lines.append(None)
            return
        # A diverged run's "NaN" is a number here (as in a file from before the strict encoder), spelled when served.
        record = restore_non_finite(record)
        if _misfit(record):  # a field the pages read as a number that is not one: unreadable, never a 500
            self.unreadable += 1
            self.lines.append(None)
            return
        self.lines.append(record)
        if record.get("train_loss") is not None or record.get("tokens_per_s") is not None:
            self.latest_train = record
        if record.get("val_loss") is not None:
            self.latest_val = record
        if record.get("cost_usd") is not None:
            self.latest_cost = record
        peak = record.get("peak_memory_bytes")
        if peak is not None:
            self.peak_memory_bytes = max(int(peak), self.peak_memory_bytes or 0)


@dataclass(frozen=True)
class MetricsView:
    """A consistent snapshot of one metrics.jsonl: `count` complete lines, `unreadable` of them not records."""

    lines: list[dict[str, Any] | None]  # shared with the reader; only the first `count` belong to this view
    count: int
    unreadable: int
    partial_last_line: bool  # bytes after the last "\n": being written, or a truncated write
    mtime: float
    latest_train: dict[str, Any] | None
    latest_val: dict[str, Any] | None
    latest_cost: dict[str, Any] | None
    peak_memory_bytes: int | None
    problem: str | None = None  # why the file was not read (a link out of the runs directory)

    def records(self, since: int = 0) -> list[dict[str, Any]]:
        """The records on lines `since` … `count` - 1 (line offsets, so a poller passes the last `count`)."""
        return [r for r in self.lines[since : self.count] if r is not None]


_EMPTY = MetricsView([], 0, 0, False, 0.0, None, None, None, None)


class MetricsReader:
    """Incremental, thread-safe reader of metrics.jsonl files (a poll reads only what was appended)."""

    def __init__(self) -> None:
        self._tails: dict[Path, _Tail] = {}
        self._lock = threading.Lock()

    def read(self, path: Path) -> MetricsView:
        with self._lock:
            try:
                st = path.stat()
            except FileNotFoundError:
                self._tails.pop(path, None)
                return _EMPTY
            tail = self._tails.get(path)
            # a new file, or one replaced or truncated (a run started over): read it from the start
            if tail is None or tail.inode != st.st_ino or st.st_size < tail.offset:
                tail = self._tails[path] = _Tail(inode=st.st_ino)
            if st.st_size > tail.offset:
                with path.open("rb") as f:
                    f.seek(tail.offset)
                    chunk = f.read(st.st_size - tail.offset)
                end = chunk.rfind(b"\n") + 1
                for raw in chunk[:end].split(b"\n")[:-1]:
                    tail.add(raw)
                tail.offset += end
                tail.partial = end < len(chunk)
            tail.mtime = st.st_mtime
            return MetricsView(
                tail.lines, len(tail.lines), tail.unreadable, tail.partial, tail.mtime, tail.latest_train,
                tail.latest_val, tail.latest_cost, tail.peak_memory_bytes,
            )  # fmt: skip


class _FileCache:
    """Parsed small files (config.yaml, summary.json) kept until their mtime changes."""

    def __init__(self) -> None:
        self._cache: dict[Path, tuple[int, Any]] = {}
        self._lock = threading.Lock()

    def load(self, path: Path, name: str) -> tuple[Any, str | None]:
        """(the parsed content or None, a one-line problem or None) of the real file `path`, shown as `name`
        (".yaml": YAML, else JSON); a missing file is (None, None)."""
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            return None, None
        with self._lock:
            cached = self._cache.get(path)
        if cached is not None and cached[0] == mtime:
            return cached[1], None
        try:
            data: Any = (
                load_yaml(path) if name.endswith(".yaml") else load_json_file(path, what=name, expect=None)
            )
        except (UserInputError, ValueError, OSError) as exc:
            return None, f"{name} unreadable: {exc}"
        with self._lock:
            self._cache[path] = (mtime, data)
        return data, None


class RunStore:
    """The runs directory: safe name lookup, listing, and each run's parsed files."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory).resolve()
        self.metrics = MetricsReader()
        self._files = _FileCache()

    def children(self) -> list[tuple[str, Path, str]]:
        """(name, directory, kind) of every run and benchmark directly under the runs directory, by name."""
        found = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                    continue
                kind = child_kind(self.directory, Path(entry.path))
                if kind is not None:
                    found.append((entry.name, Path(entry.path), kind))
        return sorted(found)

    def resolve(self, name: str, kind: str) -> Path | None:
        """The child directory called exactly `name` of this kind; None for anything else (never a path)."""
        if not name or name.startswith(".") or any(c in name for c in "/\\\x00"):
            return None
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name == name and entry.is_dir(follow_symlinks=False):
                    path = Path(entry.path)
                    return path if child_kind(self.directory, path) == kind else None
        return None

    def _load(self, run_dir: Path, name: str) -> tuple[Any, str | None]:
        try:
            path = real_file(self.directory, run_dir / name)
        except OutsideRuns as exc:
            return None, str(exc)
        return (None, None) if path is None else self._files.load(path, name)

    def config(self, run_dir: Path) -> tuple[dict[str, Any], str | None]:
        data, problem = self._load(run_dir, "config.yaml")
        return (data if isinstance(data, dict) else {}), problem

    def _load_object(self, run_dir: Path, name: str) -> tuple[dict[str, Any] | None, str | None]:
        data, problem = self._load(run_dir, name)
        if data is not None and not isinstance(data, dict):
            return None, f"{name} unreadable: not a JSON object"
        return data, problem

    def summary(self, run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
        return self._load_object(run_dir, "summary.json")

    def plan(self, run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
        """The run's forecast as `gaudi3 train` recorded it (plan.json), or (None, why not) as `summary`."""
        return self._load_object(run_dir, PLAN_FILE)

    def metrics_view(self, run_dir: Path) -> MetricsView:
        """The run's metrics.jsonl as read so far (empty when there is none, or it links out of the runs dir)."""
        try:
            path = real_file(self.directory, run_dir / "metrics.jsonl")
        except OutsideRuns as exc:
            return replace(_EMPTY, problem=str(exc))
        return _EMPTY if path is None else self.metrics.read(path)

    def _mtime(self, run_dir: Path, name: str) -> float | None:
        try:
            path = real_file(self.directory, run_dir / name)
        except OutsideRuns:
            return None
        return None if path is None else path.stat().st_mtime

    def status(self, run_dir: Path, view: MetricsView) -> str:
        """finished (summary.json newer than the last metrics), running (metrics written lately) or stopped."""
        summary_mtime = self._mtime(run_dir, "summary.json")
        if summary_mtime is not None and summary_mtime >= view.mtime - 1.0:
            return "finished"
        newest = max(view.mtime, self._mtime(run_dir, "config.yaml") or 0.0)
        return "running" if time.time() - newest < STALE_S else "stopped"

    def overview(self, name: str, run_dir: Path) -> dict[str, Any]:
        """What the run list and the live view show: progress, latest metrics, cost, status and warnings."""
        view = self.metrics_view(run_dir)
        config, config_problem = self.config(run_dir)
        summary, summary_problem = self.summary(run_dir)
        status = self.status(run_dir, view)
        # A last line without "\n" is still being written, unless the run is over or it stayed so for a while.
        truncated = view.partial_last_line and (
            status != "running" or time.time() - view.mtime > PARTIAL_GRACE_S
        )
        unreadable = view.unreadable + int(truncated)
        warnings = [p for p in (config_problem, summary_problem, view.problem) if p]
        if unreadable:
            warnings.append(f"{unreadable} unreadable line{'s' if unreadable != 1 else ''} in metrics.jsonl")
        train, val, cost = view.latest_train or {}, view.latest_val or {}, view.latest_cost or {}
        return {
            "name": name,
            "status": status,
            "model": config_section(config, "model").get("name"),
            "device": (summary or {}).get("device"),
            "step": max(train.get("step") or 0, val.get("step") or 0) if view.count else None,
            "max_steps": _count(config_section(config, "train").get("max_steps")),  # a hand-edited file's
            "train_loss": train.get("train_loss"),
            "val_loss": val.get("val_loss"),
            "tokens_per_s": train.get("tokens_per_s"),
            "mfu": train.get("mfu"),
            "peak_memory_bytes": view.peak_memory_bytes,
            # Named in the latest window (health.stragglers); None: no rank's compute measured.
            "stragglers": train.get("stragglers", [] if "compute_s_per_rank" in train else None),
            "cost_usd": cost.get("cost_usd"),
            "lines": view.count,
            "unreadable_lines": unreadable,
            "updated_unix": view.mtime or None,
            "warnings": warnings,
        }
