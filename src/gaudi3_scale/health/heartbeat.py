"""What a rank's watchdog writes under `<run>/health/`, and how it is read back (by the other ranks' watchdogs on
the same node, and by `gaudi3 health`).

    heartbeat-rank<N>.json  rewritten every few seconds: pid, host, section, step, last beat, the section's timeout
    hang-rank<N>.json       written once by a rank that found a hang: who was silent, where, for how long, the files
    stacks-rank<N>.txt      Python stacks of every thread (faulthandler), one block per dump, each after a `---` line
    py-spy-rank<N>.txt      `py-spy dump` of rank N, taken by the rank that found the hang (works on a stopped rank)
    nccl-trace-rank<N>      PyTorch's NCCL flight recorder (CUDA runs), pickled

Times come twice: `*_unix_s` for people, `*_monotonic_s` for comparisons between processes of one host (Linux's
CLOCK_MONOTONIC is system-wide, and unlike the wall clock it never jumps).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gaudi3_scale.config.atomic import write_text_atomic
from gaudi3_scale.config.errors import brief

__all__ = [
    "DONE",
    "HEALTH_DIR",
    "LAST_UNIX_S",
    "STALE_AFTER_S",
    "WRITE_EVERY_S",
    "Heartbeat",
    "hang_path",
    "heartbeat_path",
    "parse_heartbeat",
    "py_spy_path",
    "read_heartbeat",
    "read_heartbeats",
    "stacks_path",
    "write_json_atomic",
]

HEALTH_DIR = "health"  # under the run's output directory
DONE = "done"  # the section of a rank whose watchdog stopped (training ended, or raised): nobody waits on it
LAST_UNIX_S = 2**33  # the year 2242: any later "time" is not one
WRITE_EVERY_S = 2.0  # a rank's watchdog rewrites its heartbeat file this often (and at every section change)
STALE_AFTER_S = 3 * WRITE_EVERY_S  # a file older than this: the rank's watchdog thread is not running


def heartbeat_path(health_dir: Path, rank: int) -> Path:
    return health_dir / f"heartbeat-rank{rank}.json"


def hang_path(health_dir: Path, rank: int) -> Path:
    return health_dir / f"hang-rank{rank}.json"


def stacks_path(health_dir: Path, rank: int) -> Path:
    return health_dir / f"stacks-rank{rank}.txt"


def py_spy_path(health_dir: Path, rank: int) -> Path:
    return health_dir / f"py-spy-rank{rank}.txt"


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    rank: int
    local_rank: int
    pid: int
    host: str
    parent_pid: int  # the launcher's agent: the ranks of one launch on one node share it
    attempt: int  # torchrun's TORCHELASTIC_RESTART_COUNT: a restarted group's files replace the failed one's
    main_thread_id: (
        int  # threading.main_thread().ident: which block of a faulthandler dump is the training loop
    )
    section: str  # setup | step | checkpoint | validation | done
    step: int  # the optimizer steps done (the last beat's)
    timeout_s: float  # this section's timeout now: silence longer than this is a hang
    step_timeout_s: float | None  # configured, or derived once the first steps were measured; None: not yet
    last_beat_unix_s: float
    last_beat_monotonic_s: float
    written_unix_s: float
    written_monotonic_s: float

    def silent_s(self, now_monotonic_s: float) -> float:
        return now_monotonic_s - self.last_beat_monotonic_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def write_json_atomic(path: Path, record: dict[str, Any]) -> None:
    """Readers on other processes see the old file or the new one, never half of one."""
    write_text_atomic(path, json.dumps(record, indent=1) + "\n")


def read_heartbeat(path: Path) -> Heartbeat | None:
    """The heartbeat in `path`, or None when there is none or it is not one (a file of an older layout, damaged)."""
    try:
        return parse_heartbeat(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # being replaced right now (os.replace is atomic on POSIX, but not on every network FS)


_TEXT_FIELDS = frozenset({"host", "section"})
_TIME_FIELDS = frozenset(
    {"last_beat_unix_s", "written_unix_s"}
)  # shown as dates: within what gmtime can show
_NUMBER_FIELDS = frozenset({"timeout_s", "step_timeout_s", "last_beat_monotonic_s", "written_monotonic_s"})


def parse_heartbeat(record: Any) -> Heartbeat:
    """A heartbeat file's JSON as a `Heartbeat`; ValueError naming the first field that is missing or not of its
    type (counts and ids: whole numbers ≥ 0; seconds: finite numbers; times: from 1970 to 2242)."""
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object")
    values = {}
    for f in dataclasses.fields(Heartbeat):
        if f.name not in record:
            raise ValueError(f"{f.name} is missing")
        value = values[f.name] = record[f.name]
        if f.name in _TEXT_FIELDS:
            ok = isinstance(value, str)
        elif f.name in _NUMBER_FIELDS | _TIME_FIELDS:
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            ok = ok or (f.name == "step_timeout_s" and value is None)
            ok = ok and not (f.name in _TIME_FIELDS and not 0 <= value < LAST_UNIX_S)
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        if not ok:
            raise ValueError(f"{f.name} is {brief(value)}, not {_KINDS.get(f.name, 'a whole number ≥ 0')}")
    return Heartbeat(**values)


_KINDS = {
    **dict.fromkeys(_TEXT_FIELDS, "a string"),
    **dict.fromkeys(_NUMBER_FIELDS, "a finite number"),
    **dict.fromkeys(_TIME_FIELDS, "a time (seconds since 1970, before 2242)"),
}


def read_heartbeats(health_dir: Path) -> dict[int, Heartbeat]:
    """Every rank's heartbeat in `health_dir`, by rank."""
    found = {}
    for path in sorted(health_dir.glob("heartbeat-rank*.json")):
        beat = read_heartbeat(path)
        if beat is not None:
            found[beat.rank] = beat
    return found
