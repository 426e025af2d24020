"""Finding a supervised job's process group and what is left of it (tests of `distributed.jobs.run_job`'s callers)."""

from __future__ import annotations

import os
import signal
import time

import psutil

__all__ = ["alive_in_group", "kill_what_is_left", "wait_for_job_group"]


def alive_in_group(pgid: int) -> list[int]:
    """Processes of group `pgid` still running (a zombie waiting for its reaper has ended)."""
    alive = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


def wait_for_job_group(supervisor_pid: int, timeout_s: float = 120.0) -> int:
    """The process group of the first job `supervisor_pid` starts: a child that leads a group of its own."""
    deadline = time.monotonic() + timeout_s
    supervisor = psutil.Process(supervisor_pid)
    while time.monotonic() < deadline:
        for child in supervisor.children():
            try:
                if os.getpgid(child.pid) == child.pid:
                    return child.pid
            except ProcessLookupError:
                continue
        if not supervisor.is_running() or supervisor.status() == psutil.STATUS_ZOMBIE:
            raise AssertionError(f"process {supervisor_pid} ended before it started a job")
        time.sleep(0.05)
    raise AssertionError(f"process {supervisor_pid} started no job within {timeout_s:g} s")


def kill_what_is_left(pgid: int) -> list[int]:
    """The processes of group `pgid` still running, each then killed (a test that fails leaves no orphan behind)."""
    left = alive_in_group(pgid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    return left
