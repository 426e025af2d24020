"""One training run per run directory: a lock the kernel releases when its holders die.

Two runs writing one `--out` interleave `metrics.jsonl` and race for the same `step-X/` (seen after `kill -9` of a
launcher whose ranks trained on while the same command ran again). So a run holds `flock` on `<out>/.run.lock`
(`.run.node<K>.lock` on node K > 0: nodes sharing one file system each lock their own) from before it reads any
checkpoint until it ends, and a second run is refused with one line naming the holder's pid.

The holder is a *group*: the process that leads the run on this node (a single process, or the launcher) and the
ranks it starts, whose parent it is. The leader takes the lock exclusively (`LOCK_EX`, non-blocking: only one
leader wins), writes its pid into the file, then turns it into a shared lock that its ranks join (`LOCK_SH`,
after checking the file names their parent). A newcomer's `LOCK_EX` fails while any member lives, ranks orphaned
by a dead launcher included, until they finish their emergency checkpoint. Under a launcher that is not ours
(torchrun), the first rank to arrive leads, for its siblings. flock locks are released by the kernel when the
last descriptor closes, so a crash never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.distributed.env import inside_launched_worker
from gaudi3_scale.distributed.launch import process_alive

__all__ = ["RunDirectoryBusyError", "lock_path", "run_directory_lock"]

_RETRY_S = 0.02
# How long a holder's pid line may lag its lock (it is written right after the lock is taken; microseconds), so a
# rank does not mistake its own leader, still writing, for another run.
_PATIENCE_S = 0.5


class RunDirectoryBusyError(UserInputError):
    """Another training run holds the run directory."""


def lock_path(directory: Path, node_rank: int = 0) -> Path:
    return Path(directory) / (".run.lock" if node_rank == 0 else f".run.node{node_rank}.lock")


def _group() -> int:
    """The pid that leads this process's run: its launcher for a launched rank, else the process itself."""
    return os.getppid() if inside_launched_worker() else os.getpid()


@contextlib.contextmanager
def run_directory_lock(directory: Path, *, node_rank: int = 0) -> Iterator[None]:
    """Hold the run directory for this process's run (see the module docstring); `RunDirectoryBusyError` if taken.

    A directory created here that holds nothing but the lock file when the run ends (a run refused for bad
    input) is removed again.
    """
    directory = Path(directory)
    created = not directory.exists()
    path = lock_path(directory, node_rank)
    fd = _acquire(path, _group())
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if created and [p.name for p in directory.iterdir()] == [path.name]:
                path.unlink()  # while still locked: a newcomer that opened it re-checks the inode (_is_current)
                directory.rmdir()
        os.close(fd)


def _acquire(path: Path, group: int) -> int:
    deadline = time.monotonic() + _PATIENCE_S
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        held = _lead(fd, group) or (_holder(fd) == group and _try_lock(fd, fcntl.LOCK_SH))
        if held and _is_current(fd, path):
            return fd
        holder = _holder(fd)
        os.close(fd)
        if not held and holder != group and time.monotonic() > deadline:
            raise RunDirectoryBusyError(_busy_message(path.parent, holder))
        time.sleep(_RETRY_S)


def _try_lock(fd: int, operation: int) -> bool:
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _lead(fd: int, group: int) -> bool:
    """Take the lock as the group's leader: exclusive, record the group, then shared so that its ranks can join."""
    if not _try_lock(fd, fcntl.LOCK_EX):
        return False
    if _holder(fd) != group:  # the same leader again (a resume in this process) leaves the file as it was
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{group}\n".encode(), 0)
    # Not atomic (flock(2)): another leader may win in between; then this one holds nothing and tries again.
    return _try_lock(fd, fcntl.LOCK_SH)


def _holder(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def _is_current(fd: int, path: Path) -> bool:
    """Whether `fd` is still the file at `path` (a run that ended may have removed it after we opened it)."""
    try:
        on_disk = path.stat()
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (opened.st_dev, opened.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def _busy_message(directory: Path, holder: int | None) -> str:
    if holder is None:
        who = "another training run"
    elif process_alive(holder):
        who = f"another training run (pid {holder})"
    else:  # its ranks outlive it for as long as their emergency checkpoint takes
        who = f"the ranks of a training run whose launcher (pid {holder}) has exited; they are saving and stopping"
    return f"run directory {str(directory)!r} is in use by {who}; wait for it to end, stop it, or pass another --out"
