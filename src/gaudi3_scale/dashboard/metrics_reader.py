"""Reading metrics.jsonl files as they grow: incrementally, with memory and time bounded whatever their length.

Each file's lines are parsed once; a poll reads only the bytes appended since (in `CHUNK_BYTES` chunks). What is
kept of a file is what the views need: its latest train, validation and cost records, its counts and peak memory,
its last `TAIL_LINES` lines whole, and a downsampled chart of the lines before them (`series`). A line that is not
a JSON object of the fields `gaudi3 train` writes is counted as unreadable, never fatal; a last line without "\\n"
is kept aside (at most `MAX_LINE_BYTES`) and never scanned twice.

Each file has its own lock, so reading one run's file never waits for another's. A request parses for at most
`READ_BUDGET_S`; a longer first read (a run of millions of steps) goes on in a background thread, and meanwhile the
views show what was read so far, saying so (`MetricsView.reading`). Files that are gone are forgotten.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gaudi3_scale.config.numbers import is_number
from gaudi3_scale.config.strict_json import restore_non_finite
from gaudi3_scale.dashboard.series import Downsampled

__all__ = ["EMPTY", "MetricsReader", "MetricsView"]

TAIL_LINES = (
    1000  # kept whole: a poller this many lines behind gets exact records (the ETA reads the last 400)
)
CHUNK_BYTES = 4 << 20
MAX_LINE_BYTES = 1 << 20  # a metrics record is a few hundred bytes: a longer line is unreadable, not buffered
READ_BUDGET_S = 0.5  # a request's share of a long first read; the rest goes on in the background
SWEEP_S = 30.0  # how often the reader forgets files that are gone (a deleted or renamed run)

# What the pages and the API read from a record as numbers (a diverged loss may be NaN or infinite; a count not).
_COUNTS = ("step", "tokens_seen", "peak_memory_bytes")
_NUMBERS = ("train_loss", "val_loss", "tokens_per_s", "mfu", "wall_s", "step_time_s",
            "time_unix", "cost_usd", "cost_usd_per_hour", "cost_projected_usd", "cost_budget_usd",
            "cost_budget_remaining_usd", "projected_finish_unix", "scaling_efficiency")  # fmt: skip


def _number(value: Any) -> bool:
    """A JSON number the views can compute with: an int too large for a float (JSON allows 4,300 digits) is not."""
    return is_number(value) and not (isinstance(value, int) and abs(value) > sys.float_info.max)


def _misfit(record: dict[str, Any]) -> bool:
    """Whether a metrics record holds a field of another type than `gaudi3 train` writes there."""
    for key in _COUNTS:
        value = record.get(key)
        if value is not None and not (_number(value) and math.isfinite(value) and value >= 0):
            return True
    if any(record.get(k) is not None and not _number(record[k]) for k in _NUMBERS):
        return True
    stragglers = record.get("stragglers")
    return stragglers is not None and not (
        isinstance(stragglers, list)
        and all(isinstance(r, int) and not isinstance(r, bool) for r in stragglers)
    )


def _parse(raw: bytes) -> dict[str, Any] | None:
    """The record on a line, or None when the line is not one (`_misfit`, not JSON, not an object, too long)."""
    if len(raw) > MAX_LINE_BYTES:
        return None
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):  # also UnicodeDecodeError; absurd nesting
        return None
    if not isinstance(record, dict):
        return None
    # A diverged run's "NaN" is a number here (as in a file from before the strict encoder), spelled when served.
    record = restore_non_finite(record)
    return None if _misfit(record) else record


@dataclass(frozen=True)
class MetricsView:
    """A consistent snapshot of one metrics.jsonl: `count` complete lines, `unreadable` of them not records."""

    recent: tuple[dict[str, Any] | None, ...]  # lines tail_start … count - 1 (None: blank or unreadable)
    tail_start: int
    count: int
    unreadable: int
    partial_last_line: bool  # bytes after the last "\n": being written, or a truncated write
    mtime: float
    latest_train: dict[str, Any] | None
    latest_val: dict[str, Any] | None
    latest_cost: dict[str, Any] | None
    peak_memory_bytes: int | None
    history: tuple[dict[str, Any], ...] = ()  # the downsampled records of lines 0 … tail_start - 1 (`series`)
    file_id: str = ""  # changes when the file is replaced or truncated (a run started over under its name)
    reading: tuple[int, int] | None = None  # (bytes read, size) while a long first read is still going on
    problem: str | None = None  # why the file was not read (a link out of the runs directory, no permission)

    def records(self, since: int = 0) -> tuple[list[dict[str, Any]], bool]:
        """(the records on lines `since` … `count` - 1, False), or when lines before `since` are no longer kept
        whole, (the downsampled records of the whole file, True)."""
        if since >= self.tail_start:
            return [r for r in self.recent[since - self.tail_start :] if r is not None], False
        return [*self.history, *(r for r in self.recent if r is not None)], True


EMPTY = MetricsView((), 0, 0, 0, False, 0.0, None, None, None, None)


class _File:
    """What is kept of one metrics.jsonl (module docstring); `lock` is held while it is read."""

    def __init__(self, inode: int) -> None:
        self.lock = threading.Lock()
        self.start_over(inode)

    def start_over(self, inode: int) -> None:
        """Forget what was read: a new file (or this one replaced or truncated: a run started over)."""
        self.inode, self.file_id = inode, secrets.token_hex(4)
        self.read_bytes = 0  # consumed: complete lines and `pending`
        self.pending = b""  # the last line's bytes so far (no "\n" yet)
        self.overlong = False  # the last line passed MAX_LINE_BYTES: skipped up to its "\n"
        self.count = self.unreadable = self.tail_start = 0
        self.recent: deque[dict[str, Any] | None] = deque()
        self.history = Downsampled()
        self.latest: dict[str, dict[str, Any] | None] = {"train": None, "val": None, "cost": None}
        self.peak_memory_bytes: int | None = None
        self.seen: tuple[int, float] | None = None  # (size, mtime) of the published view
        self.view = EMPTY

    def add(self, raw: bytes | None) -> None:
        """One complete line (None: one too long to have been kept)."""
        blank = raw is not None and not raw.strip()
        record = None if raw is None or blank else _parse(raw)
        if record is None and not blank:
            self.unreadable += 1
        self.count += 1
        self.recent.append(record)
        if len(self.recent) > TAIL_LINES:
            old = self.recent.popleft()
            if old is not None:
                self.history.add(self.tail_start, old)
            self.tail_start += 1
        if record is None:
            return
        if record.get("train_loss") is not None or record.get("tokens_per_s") is not None:
            self.latest["train"] = record
        if record.get("val_loss") is not None:
            self.latest["val"] = record
        if record.get("cost_usd") is not None:
            self.latest["cost"] = record
        peak = record.get("peak_memory_bytes")
        if peak is not None:
            self.peak_memory_bytes = max(int(peak), self.peak_memory_bytes or 0)

    def feed(self, chunk: bytes) -> None:
        """The next bytes of the file: complete lines are added, the rest waits in `pending`."""
        *lines, rest = chunk.split(b"\n")
        if lines:
            self.add(None if self.overlong else self.pending + lines[0])
            for raw in lines[1:]:
                self.add(raw)
            self.pending, self.overlong = b"", False
        if not self.overlong:
            self.pending += rest
            if len(self.pending) > MAX_LINE_BYTES:
                self.pending, self.overlong = b"", True

    def catch_up(self, path: Path, deadline: float) -> bool:
        """Read what was appended since the last call, until `deadline` (time.monotonic); True when at the end."""
        with path.open("rb") as f:
            st = os.fstat(f.fileno())
            if (st.st_size, st.st_mtime) == self.seen and st.st_ino == self.inode:
                return True
            line_end = self.read_bytes - len(self.pending)  # where the unfinished last line starts
            if (
                st.st_ino != self.inode
                or st.st_size < line_end
                or (self.overlong and st.st_size < self.read_bytes)
            ):
                self.start_over(st.st_ino)
            elif st.st_size < self.read_bytes:  # only the unfinished last line was cut
                self.pending = self.pending[: st.st_size - self.read_bytes]
                self.read_bytes = st.st_size
            f.seek(self.read_bytes)
            while self.read_bytes < st.st_size:
                chunk = f.read(min(CHUNK_BYTES, st.st_size - self.read_bytes))
                if not chunk:
                    break
                self.read_bytes += len(chunk)
                self.feed(chunk)
                if self.read_bytes < st.st_size and time.monotonic() > deadline:  # a chunk at least per call
                    self.publish(st, reading=True)
                    return False
        self.publish(st, reading=False)
        return True

    def publish(self, st: os.stat_result, *, reading: bool) -> None:
        """Make what was read the view requests see (`reading`: in the middle of a long read, where the bytes
        after the last "\\n" are where a chunk ended, not a last line)."""
        self.seen = None if reading else (st.st_size, st.st_mtime)
        partial = (bool(self.pending) or self.overlong) and not reading
        self.view = MetricsView(
            tuple(self.recent), self.tail_start, self.count, self.unreadable, partial,
            st.st_mtime, self.latest["train"], self.latest["val"], self.latest["cost"], self.peak_memory_bytes,
            self.history.records(), self.file_id, (self.read_bytes, st.st_size) if reading else None,
        )  # fmt: skip


class MetricsReader:
    """Incremental, thread-safe reader of metrics.jsonl files (module docstring)."""

    def __init__(self, budget_s: float = READ_BUDGET_S, sweep_s: float = SWEEP_S) -> None:
        self.budget_s, self.sweep_s = budget_s, sweep_s
        self._files: dict[Path, _File] = {}
        self._lock = threading.Lock()  # guards `_files` only: never held while a file is read
        self._swept = time.monotonic()

    def __len__(self) -> int:
        """How many files are held."""
        return len(self._files)

    def read(self, path: Path) -> MetricsView:
        """The file at `path` (a real path) as read so far; a file that cannot be opened: EMPTY with the problem."""
        self._sweep()
        try:
            inode = path.stat().st_ino
        except FileNotFoundError:
            return EMPTY
        with self._lock:
            file = self._files.setdefault(path, _File(inode))
        # Another request is reading it: wait a little, then show what is read so far (at once during a long read).
        if not file.lock.acquire(timeout=0 if file.view.reading else self.budget_s):
            return file.view
        done = True
        try:
            done = file.catch_up(path, time.monotonic() + self.budget_s)
        except FileNotFoundError:
            return EMPTY
        except OSError as exc:  # no permission, an I/O error: this run's problem, not the run list's
            return replace(EMPTY, problem=f"metrics.jsonl unreadable: {exc.strerror or exc}")
        finally:
            if done:
                file.lock.release()
        if done:
            return file.view
        threading.Thread(
            target=self._finish, args=(file, path), name="gaudi3-dashboard-read", daemon=True
        ).start()
        return file.view

    @staticmethod
    def _finish(file: _File, path: Path) -> None:
        """The rest of a long first read, holding the file's lock that `read` handed over."""
        try:
            file.catch_up(path, float("inf"))
        except OSError as exc:
            file.view = replace(
                file.view, reading=None, problem=f"metrics.jsonl unreadable: {exc.strerror or exc}"
            )
        finally:
            file.lock.release()

    def _sweep(self) -> None:
        """Forget the files that are gone, at most every `sweep_s`."""
        now = time.monotonic()
        if now - self._swept < self.sweep_s:
            return
        self._swept = now
        with self._lock:
            paths = list(self._files)
        gone = [p for p in paths if not p.is_file()]
        with self._lock:
            for path in gone:
                self._files.pop(path, None)
