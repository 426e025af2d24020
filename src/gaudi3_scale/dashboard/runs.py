"""What the dashboard reads from `--runs DIR`: its direct child directories and a training run's files.

A child directory is a **run** (it holds `config.yaml`, `metrics.jsonl` or `summary.json`, as `gaudi3 train`
leaves them) or a **benchmark** result set (`matrix.yaml` + `cells/` from `gaudi3 benchmark run`, or a
`report/report.html` from `gaudi3 benchmark report`). A name from a URL is only ever looked up among the entries
`os.scandir` lists (symlinks are not followed), so `..`, `/`, absolute paths and links out of DIR name nothing;
every file inside a run is reached through `files` (a symlink out of the runs directory is never read).

`metrics.jsonl` is read incrementally, with bounded memory and time (`metrics_reader`). A line that is not a
JSON object is counted as unreadable, never fatal.

An entry the run list cannot show or link (a name that is not UTF-8, a directory the server may not enter) is
named in `unlisted`, so that it does not vanish without a word.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gaudi3_scale.config.core import load_yaml
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.config.files import load_json_file
from gaudi3_scale.dashboard.files import OutsideRuns, has_file, real_file
from gaudi3_scale.dashboard.metrics_reader import EMPTY, MetricsReader, MetricsView
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


def _unlisted_because(entry: os.DirEntry[str]) -> str | None:
    """Why a child directory cannot be listed and linked, or None when it can: its name must survive the pages'
    UTF-8 (a name made of other bytes would fail every link to it), and the server must be able to look inside."""
    try:
        entry.name.encode("utf-8")
    except UnicodeEncodeError:
        return "not listed: its name is not UTF-8"
    if not os.access(entry.path, os.R_OK | os.X_OK):
        return "not listed: the dashboard may not read this directory (permission denied)"
    return None


class RunStore:
    """The runs directory: safe name lookup, listing, and each run's parsed files."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory).resolve()
        self.metrics = MetricsReader()
        self._files = _FileCache()

    def _entries(self) -> list[os.DirEntry[str]]:
        """The child directories of the runs directory that could be runs (not hidden, not links)."""
        with os.scandir(self.directory) as entries:
            return [e for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]

    def children(self) -> list[tuple[str, Path, str]]:
        """(name, directory, kind) of every run and benchmark directly under the runs directory, by name."""
        found = []
        for entry in self._entries():
            if _unlisted_because(entry) is None:
                kind = child_kind(self.directory, Path(entry.path))
                if kind is not None:
                    found.append((entry.name, Path(entry.path), kind))
        return sorted(found)

    def unlisted(self) -> list[str]:
        """One line per child directory the run list cannot show (`_unlisted_because`), by name."""
        lines = []
        for entry in self._entries():
            why = _unlisted_because(entry)
            if why is not None:
                lines.append(f"{ascii(os.fsencode(entry.name))[2:-1]}: {why}")
        return sorted(lines)

    def resolve(self, name: str, kind: str) -> Path | None:
        """The child directory called exactly `name` of this kind; None for anything else (never a path)."""
        if not name or name.startswith(".") or "/" in name or "\x00" in name:
            return None
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if (
                    entry.name == name
                    and entry.is_dir(follow_symlinks=False)
                    and _unlisted_because(entry) is None
                ):
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
            return replace(EMPTY, problem=str(exc))
        return EMPTY if path is None else self.metrics.read(path)

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
        if view.reading is not None:
            done, size = view.reading
            warnings.append(
                f"metrics.jsonl still being read ({done / 2**20:,.0f} of {size / 2**20:,.0f} MiB so far)"
            )
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
