"""One run per run directory: a second writer is refused with one line naming the holder; the kernel frees the lock
when its holders die (kill -9 included); ranks of the holder's run share it, and ranks orphaned by a dead launcher
keep it until they end; such ranks get SIGTERM from the kernel (parent-death signal) instead of training on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gaudi3_scale.train.run_lock import RunDirectoryBusyError, lock_path, run_directory_lock

SRC = str(Path(__file__).resolve().parents[2] / "src")
WORKER_ENV = {"LOCAL_RANK": "0", "WORLD_SIZE": "2"}  # what a launcher gives its ranks

# A run's leader: takes the lock, optionally starts one rank (MEMBER or ORPHANED below) and prints its pid.
LEADER = """
import os, subprocess, sys, time
from pathlib import Path
from gaudi3_scale.train.run_lock import run_directory_lock
with run_directory_lock(Path(sys.argv[1])):
    if len(sys.argv) > 2:
        rank = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                                     "GAUDI3_LAUNCHER_PID": str(os.getpid())})
        assert rank.stdout.readline().strip() == "ready"
        print(rank.pid, flush=True)
    else:
        print(os.getpid(), flush=True)
    time.sleep(60)
"""
MEMBER = """
import sys, time
from pathlib import Path
from gaudi3_scale.train.run_lock import run_directory_lock
with run_directory_lock(Path(sys.argv[1])):
    print("ready", flush=True)
    time.sleep(60)
"""
ORPHANED = """
import signal, sys, time
from pathlib import Path
from gaudi3_scale.distributed.launch import stop_with_launcher
signal.signal(signal.SIGTERM, lambda *_: (Path(sys.argv[1], "got").write_text("SIGTERM"), sys.exit(143)))
stop_with_launcher()
print("ready", flush=True)
time.sleep(60)
"""


Spawn = Callable[..., tuple[subprocess.Popen[str], str]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start `python -c CODE ARGS…` with our sources; returns (process, first line it printed). Kills leftovers."""
    started: list[int] = []

    def run(code: str, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": SRC, **(env or {})},
        )  # fmt: skip
        line = proc.stdout.readline().strip() if proc.stdout else ""
        started.extend([proc.pid, *([int(line)] if line.isdigit() else [])])
        return proc, line

    yield run
    for pid in started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":  # exited, not yet reaped
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(autouse=True)
def _not_a_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*WORKER_ENV, "GAUDI3_LAUNCHER_PID"):
        monkeypatch.delenv(name, raising=False)


def test_a_second_run_is_refused_naming_the_holder_and_kill_9_frees_it(tmp_path: Path, spawn: Spawn) -> None:
    run = tmp_path / "run"
    holder, pid = spawn(LEADER, str(run))
    with pytest.raises(RunDirectoryBusyError) as refused, run_directory_lock(run):
        pytest.fail("two runs held one directory")
    message = str(refused.value)
    assert f"in use by another training run (pid {pid})" in message and "\n" not in message
    assert "pass another --out" in message
    holder.kill()
    holder.wait()
    with run_directory_lock(run):  # the kernel released it: no stale lock after a crash
        assert lock_path(run).read_text().strip() == str(os.getpid())
    assert not run.exists() or list(run.iterdir()) == [lock_path(run)]


def test_ranks_share_their_launchers_lock_and_orphans_keep_it(tmp_path: Path, spawn: Spawn) -> None:
    run = tmp_path / "run"
    launcher, member_pid = spawn(LEADER, str(run), MEMBER)  # the member printed "ready": it joined
    assert member_pid.isdigit() and lock_path(run).read_text().strip() == str(launcher.pid)
    # Not a rank of that launcher (no launcher environment, or another parent): refused.
    stranger, line = spawn(MEMBER, str(run), env=WORKER_ENV)
    assert stranger.wait(timeout=10) == 1 and line == ""
    launcher.kill()  # kill -9 of the launcher: its rank lives on, and so does the lock
    launcher.wait()
    busy = pytest.raises(RunDirectoryBusyError, match=rf"launcher \(pid {launcher.pid}\) has exited")
    with busy, run_directory_lock(run):
        pass
    os.kill(int(member_pid), signal.SIGKILL)
    assert _gone(int(member_pid))
    with run_directory_lock(run):
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_rank_gets_sigterm_when_its_launcher_is_killed(tmp_path: Path, spawn: Spawn) -> None:
    launcher, rank_pid = spawn(LEADER, str(tmp_path / "run"), ORPHANED)
    assert rank_pid.isdigit()
    launcher.kill()
    launcher.wait()
    assert _gone(int(rank_pid)), "the rank trained on without its launcher"
    assert (tmp_path / "run" / "got").read_text() == "SIGTERM"
