"""What a run's `health/` directory says happened, per rank: `gaudi3 health RUN` prints `format_health(read_health(RUN))`.

A damaged file (invalid JSON, wrong-typed fields, a directory in its place, a metrics.jsonl line that is not UTF-8)
is one `damaged:` line of the report naming the file and what is wrong, and the rest is reported as usual; only a
run with nothing readable left is refused (one line, exit 2).

It reads the files the watchdog writes (`health.heartbeat`): the hang reports, each rank's last heartbeat, and the
top frames of the training loop's thread in the newest stack dump of each rank (faulthandler's and py-spy's); and
the step guard's events of the run's metrics.jsonl (non-finite steps, spikes, rollbacks, re-run verdicts).
"""

from __future__ import annotations

import json
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gaudi3_scale.config import strict_json
from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.health.deadlines import Silence
from gaudi3_scale.health.heartbeat import (
    DONE,
    HEALTH_DIR,
    LAST_UNIX_S,
    STALE_AFTER_S,
    Heartbeat,
    parse_heartbeat,
    py_spy_path,
    stacks_path,
)

__all__ = [
    "HealthReport",
    "RankHealth",
    "StackDump",
    "format_health",
    "rank_stopped",
    "read_events",
    "read_health",
    "top_frames",
]

TOP_FRAMES = 4
_FAULTHANDLER_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_HANG_FILE = re.compile(r"^hang-rank(\d+)\.json$")
_HEARTBEAT_FILE = re.compile(r"^heartbeat-rank(\d+)\.json$")
_RANK_FILE = re.compile(r"^(?:heartbeat|stacks|py-spy)-rank(\d+)\.(?:json|txt)$")


@dataclass(frozen=True)
class StackDump:
    path: Path
    header: str | None  # the `---` line of the newest dump (faulthandler files), None for py-spy's
    frames: list[str]  # the training loop's innermost frames first, as `function (file:line)`
    note: str | None = None  # why there are no frames


@dataclass
class RankHealth:
    rank: int
    heartbeat: Heartbeat | None
    dumps: list[StackDump] = field(default_factory=list)
    heartbeat_damaged: bool = False  # its heartbeat file is there but unreadable (a `damaged:` line says why)
    # Why a rank that is not `done` trains no more (`rank_stopped`); None: it may still be training.
    stopped: str | None = None


@dataclass
class HealthReport:
    health_dir: Path
    hangs: list[dict[str, Any]]  # hang-rank<N>.json records, oldest first
    ranks: list[RankHealth]
    events: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl's health events, in order
    damaged: list[str] = field(default_factory=list)  # "<file>: what is wrong", one per damaged file or line
    damaged_hangs: int = 0  # hang reports among them: "no hang recorded" would not be true

    def readable(self) -> bool:
        """Anything to report besides the damage: a hang, a heartbeat, a stack dump or an event."""
        return bool(self.hangs or self.events or any(r.heartbeat or r.dumps for r in self.ranks))


def read_health(run_dir: Path) -> HealthReport:
    if not run_dir.is_dir():  # a typo in the path, not a run trained without the watchdog
        raise UserInputError(f"{run_dir}: no such directory; pass the output directory of a run")
    health_dir = run_dir / HEALTH_DIR
    events, damaged = read_events(run_dir / "metrics.jsonl")
    if not health_dir.is_dir():
        if not events and not damaged:
            raise UserInputError(
                f"{run_dir}: no {HEALTH_DIR}/ directory here; expected the output directory of a run trained with "
                "health.watchdog true (the default)"
            )
        return _readable(run_dir, HealthReport(health_dir, [], [], events, damaged))
    try:
        paths = sorted(health_dir.iterdir())
    except OSError as exc:
        raise UserInputError(f"{health_dir}: cannot be read ({exc.strerror or exc})") from None
    hangs: list[dict[str, Any]] = []
    beats: dict[int, Heartbeat] = {}
    broken: set[int] = set()  # ranks whose heartbeat file is damaged
    damaged_hangs = 0
    for path in paths:
        if match := _HANG_FILE.match(path.name):
            problem, record = _load_json(path)
            problem = problem or _hang_problem(record)
            if problem:
                damaged.append(f"{path}: not a hang report ({problem})")
                damaged_hangs += 1
            else:
                hangs.append(record)
        elif match := _HEARTBEAT_FILE.match(path.name):
            problem, record = _load_json(path)
            if problem is None:
                try:
                    beats[int(match[1])] = parse_heartbeat(record)
                except ValueError as exc:
                    problem = str(exc)
            if problem:
                damaged.append(f"{path}: not a heartbeat ({problem})")
                broken.add(int(match[1]))
    hangs.sort(key=lambda r: r["detected_unix_s"])
    ranks = sorted({*beats, *(int(m[1]) for p in paths if (m := _RANK_FILE.match(p.name)))})
    report = HealthReport(health_dir, hangs, [], events, damaged, damaged_hangs)
    for rank in ranks:
        report.ranks.append(_rank_health(health_dir, rank, beats.get(rank), damaged))
        report.ranks[-1].heartbeat_damaged = rank in broken
        report.ranks[-1].stopped = rank_stopped(beats[rank], time.time()) if rank in beats else None
    return _readable(run_dir, report)


def _readable(run_dir: Path, report: HealthReport) -> HealthReport:
    """`report`, unless it is all damage: then one line naming the first damaged file (exit 2)."""
    if report.damaged and not report.readable():
        more = len(report.damaged) - 1
        raise UserInputError(
            f"{run_dir}: nothing readable: {report.damaged[0]}"
            + (f" (and {more} more damaged file{'s' if more > 1 else ''})" if more else "")
        )
    return report


def _load_json(path: Path) -> tuple[str | None, Any]:
    """(None, the JSON in `path`), or (what keeps it from being read, None)."""
    try:
        return None, json.loads(path.read_text())
    except UnicodeDecodeError:
        return "not UTF-8 text", None
    except ValueError:
        return "invalid JSON", None
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}", None


_HANG_NUMBERS = {
    "detected_by_rank": int,
    "detected_by_step": int,
    "detected_unix_s": int | float,
    "exit_code": int,
}


def _hang_problem(record: Any) -> str | None:
    """What keeps a parsed hang report from being shown (the watchdog writes `health.watchdog.hang_record`)."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    for key, kind in _HANG_NUMBERS.items():
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"{key} is {brief(value)}, not a number"
    if not 0 <= record["detected_unix_s"] < LAST_UNIX_S:
        return f"detected_unix_s {brief(record['detected_unix_s'])} is not a time"
    silent = record.get("silent", [])
    try:
        for entry in silent:
            Silence.from_record(entry).describe()
    except (AttributeError, KeyError, TypeError, ValueError):
        return f"silent is {brief(silent)}, not a list of silent ranks"
    return None


def read_events(metrics: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The health events of a metrics.jsonl (records with `health_event`), and its damaged lines ("<file>: line N:
    what is wrong"); a torn line (a run killed while writing it) and JSON that is not a record are passed over."""
    if not metrics.is_file():
        return [], []
    try:
        data = metrics.read_bytes()
    except OSError as exc:
        return [], [f"{metrics}: cannot be read: {exc.strerror or exc}"]
    events, damaged = [], []
    for number, raw in enumerate(data.splitlines(), start=1):
        if b'"health_event"' not in raw:
            continue
        try:
            record = json.loads(raw.decode())
        except UnicodeDecodeError:
            damaged.append(f"{metrics}: line {number}: not UTF-8 text")
            continue
        except ValueError:
            continue  # a line being written when the run was killed
        if not isinstance(record, dict):  # not a record the run wrote
            continue
        rerun = record.get("rerun")
        if "rerun" in record and not (isinstance(rerun, dict) and isinstance(rerun.get("verdict"), str)):
            damaged.append(
                f"{metrics}: line {number}: the health event's rerun is {brief(rerun)}, without a verdict"
            )
            continue
        events.append(strict_json.restore_non_finite(record))
    return events, damaged


def _rank_health(health_dir: Path, rank: int, beat: Heartbeat | None, damaged: list[str]) -> RankHealth:
    health = RankHealth(rank, beat)
    stacks, spy = stacks_path(health_dir, rank), py_spy_path(health_dir, rank)
    try:
        if stacks.is_file() and stacks.stat().st_size:
            health.dumps.append(_faulthandler_dump(stacks, beat))
        if spy.is_file():
            health.dumps.append(_py_spy_dump(spy, beat))
    except OSError as exc:
        damaged.append(f"{exc.filename or stacks}: cannot be read: {exc.strerror or exc}")
    return health


def rank_stopped(beat: Heartbeat, now_unix_s: float) -> str | None:
    """Why a rank whose last heartbeat says it is training is not any more, or None. Read after a crash (a kill -9,
    the OOM killer), its heartbeat still says `in step`: the line would read as a live rank within its timeout.

    Its pid is looked up when it ran on this host; elsewhere the file's age tells, as it tells the watchdog of a
    peer (older than `STALE_AFTER_S`: its watchdog thread stopped writing)."""
    if beat.section == DONE:
        return None
    age_s = now_unix_s - beat.written_unix_s
    if beat.host == socket.gethostname():
        # imported here: it imports torch, and only a rank of this host has a pid to ask about
        from gaudi3_scale.distributed.launch import process_alive

        if not process_alive(beat.pid):
            return f"process not running (killed or crashed), heartbeat {age_s:.0f} s old"
    if age_s <= STALE_AFTER_S:
        return None
    return f"heartbeat {age_s:.0f} s old: stale, its watchdog stopped writing (killed, crashed or frozen)"


def _faulthandler_dump(path: Path, beat: Heartbeat | None) -> StackDump:
    """The newest dump in a stacks file: the lines after its last `---` header."""
    lines = path.read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("--- ")]
    header = lines[starts[-1]][4:] if starts else None
    body = lines[starts[-1] + 1 :] if starts else lines
    thread = f"0x{beat.main_thread_id:016x}" if beat is not None else None
    frames = top_frames(body, thread_marker=thread)
    note = (
        None if frames else "no stacks after the request: the process did not run again (stopped or killed)"
    )
    return StackDump(path, header, frames, note)


def _py_spy_dump(path: Path, beat: Heartbeat | None) -> StackDump:
    lines = path.read_text(errors="replace").splitlines()
    errors = [line for line in lines if line.startswith("Error:")]
    if errors:
        return StackDump(path, None, [], f"py-spy failed: {errors[0][len('Error:') :].strip()}")
    # py-spy names threads by their Linux thread id; the main thread's is the process id.
    marker = f"Thread {beat.pid} " if beat is not None else None
    frames = top_frames(lines, thread_marker=marker, py_spy=True)
    return StackDump(path, None, frames, None if frames else "no Python frames found")


def top_frames(lines: list[str], *, thread_marker: str | None, py_spy: bool = False) -> list[str]:
    """The first TOP_FRAMES frames of the thread whose header line contains `thread_marker` (faulthandler's
    `Thread 0x…` / `Current thread 0x…`, py-spy's `Thread <tid>`), or of the first thread when none matches."""
    blocks: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith(("Thread ", "Current thread ")):
            blocks.append((line, []))
        elif blocks and line.strip():
            frame = _py_spy_frame(line) if py_spy else _faulthandler_frame(line)
            if frame is not None:
                blocks[-1][1].append(frame)
    chosen = next(
        (b for b in blocks if thread_marker and thread_marker in b[0]), blocks[0] if blocks else None
    )
    return chosen[1][:TOP_FRAMES] if chosen else []


def _faulthandler_frame(line: str) -> str | None:
    match = _FAULTHANDLER_FRAME.match(line)
    if match is None:
        return None
    return f"{match['func']} ({_short(match['file'])}:{match['line']})"


def _py_spy_frame(line: str) -> str | None:
    if not line.startswith("    "):
        return None
    func, _, where = line.strip().partition(" (")
    return f"{func} ({_short(where.rstrip(')'))})" if where else func


def _short(file: str) -> str:
    """The last two parts of a path: enough to find the module, short enough for one line."""
    return "/".join(Path(file).parts[-2:])


def _when(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix_s))


def format_health(report: HealthReport) -> list[str]:
    lines = [f"{report.health_dir}:", *(f"damaged: {line}" for line in report.damaged)]
    for hang in report.hangs:
        silent = "; ".join(Silence.from_record(s).describe() for s in hang.get("silent", []))
        lines.append(
            f"hang found by rank {hang['detected_by_rank']} at its step {hang['detected_by_step']}, "
            f"{_when(hang['detected_unix_s'])} (attempt "
            f"{hang.get('attempt', 0)}): {silent}; exit {hang['exit_code']} (restartable)"
        )
    if not report.hangs:
        lines.append("no readable hang report" if report.damaged_hangs else "no hang recorded")
    for rank in report.ranks:
        lines += _format_rank(rank)
    lines += [f"step {e.get('step')}: {e.get('health_event')} ({e.get('health_action')}): {e.get('detail', '')}"
              + (f"; {e['rerun']['verdict']}" if isinstance(e.get("rerun"), dict) else "")
              for e in report.events]  # fmt: skip
    return lines


def _format_rank(rank: RankHealth) -> list[str]:
    beat = rank.heartbeat
    if beat is None:
        head = f"rank {rank.rank}: " + (
            "heartbeat file damaged" if rank.heartbeat_damaged else "no heartbeat file"
        )
    else:
        where = (
            f"finished (watchdog stopped) after step {beat.step}"
            if beat.section == DONE
            else f"in {beat.section} at step {beat.step} (timeout {beat.timeout_s:g} s)"
        )
        head = (
            f"rank {rank.rank}: pid {beat.pid} on {beat.host}, attempt {beat.attempt}: {where}; last beat "
            f"{_when(beat.last_beat_unix_s)}, heartbeat written {_when(beat.written_unix_s)}"
        ) + (f"; {rank.stopped}" if rank.stopped else "")
    lines = [head]
    for dump in rank.dumps:
        lines.append(f"  {dump.path}" + (f" ({dump.header})" if dump.header else ""))
        lines += [f"    {frame}" for frame in dump.frames] or [f"    {dump.note}"]
    return lines
