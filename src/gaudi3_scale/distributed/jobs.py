"""A training job run as a supervised subprocess: its own process group, a timeout, a memory budget, and a verdict.

The tuner's trials and the benchmark matrix's cells both launch `gaudi3 train` (the same CLI and launcher as any
run, several ranks included) through `run_job`, which never raises for what happens inside the job:

- ``oom``: the device's out-of-memory error in any rank's output (CUDA: ``CUDA out of memory`` /
  ``OutOfMemoryError``; CPU allocator: ``DefaultCPUAllocator: can't allocate memory`` / ``MemoryError``; Gaudi:
  ``MODULE:PT_DEVMEM Allocation failed``, the Intel Gaudi PyTorch bridge's device-memory error, e.g. as quoted in
  vllm-gaudi's calibration docs, "Troubleshooting"), a process's RSS over the memory budget (CPU: watched every
  0.2 s), or a SIGKILL we did not send (the kernel's OOM killer). When one rank fails, the launcher stops the
  others, so the ranks agree by construction: the job is OOM if any rank ran out.
- ``timeout``: no exit within `timeout_s` (a hang, or far too slow): the whole process group is killed.
- ``crash``: any other non-zero exit; the reason is the rank's own error line when there is one.

Stopping the supervisor stops the job first. The job runs in a session of its own, out of the terminal's reach, so
Ctrl-C's SIGINT reaches only the supervisor: while a job runs, SIGINT and SIGTERM are held, the job's whole process
group gets SIGTERM (the ranks' preemption signal), `STOP_GRACE_S` to exit and then SIGKILL, and only then does the
signal take its usual course (KeyboardInterrupt for Ctrl-C; SIGTERM ends the process). Any other exception that
leaves `run_job` stops the job the same way. A signal the process ignores (SIGINT of a background job) stays ignored.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["OOM_PATTERNS", "JobOutcome", "classify_failure", "run_job"]

JobStatus = Literal["ok", "oom", "crash", "timeout"]

OOM_PATTERNS = {
    "cuda": re.compile(r"CUDA out of memory|OutOfMemoryError"),
    "cpu": re.compile(r"DefaultCPUAllocator: can't allocate memory|\bMemoryError\b|Cannot allocate memory"),
    "hpu": re.compile(r"MODULE:PT_DEVMEM Allocation failed|PT_DEVMEM"),
}
_ERROR_LINE = re.compile(r"(error|Error|Exception|Traceback|FAILED|Killed)")
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b[^:]*:")
_AGENT_REPORT = re.compile(r"^(error_file|traceback|exitcode|rank|host|time|root cause)\s*:")
POLL_S = 0.2
# SIGTERM to SIGKILL when the supervisor is stopped: time for the ranks to leave their step and exit cleanly
# (trials and benchmark cells write no checkpoint), short enough for a person waiting on Ctrl-C.
STOP_GRACE_S = 5.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True, kw_only=True)
class JobOutcome:
    status: JobStatus
    reason: str  # "" when ok
    returncode: int | None  # None when its supervisor killed it
    wall_s: float
    watched_peak_rss_bytes: (
        int  # the largest RSS of any of its processes seen by the watcher (0: not watched)
    )
    log_path: Path


def classify_failure(output: str, returncode: int) -> tuple[JobStatus, str]:
    """Why a job process failed, from its exit code and the (interleaved) output of all its ranks."""
    for kind, pattern in OOM_PATTERNS.items():
        match = pattern.search(output)
        if match:
            line = next((ln for ln in output.splitlines() if match.group(0) in ln), match.group(0))
            return "oom", f"out of memory ({kind}): {_shorten(line.strip())}"
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return "oom", "killed by a SIGKILL its supervisor did not send (the kernel's OOM killer, most likely)"
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    # The rank's own cause beats the launcher's summary of it: our one-line errors first, then the last exception
    # line that is not the elastic agent reporting a failed child, then any error-looking line.
    own = [ln for ln in lines if ln.startswith("gaudi3: error:")]
    exceptions = [ln for ln in lines if _EXCEPTION_LINE.match(ln) and "ChildFailedError" not in ln]
    errors = [ln for ln in lines if _ERROR_LINE.search(ln) and not _AGENT_REPORT.match(ln)]
    fallback = (exceptions or errors or lines or [f"exit code {returncode}, no output"])[-1]
    cause = own[0] if own else fallback
    return "crash", f"exit code {returncode}: {_shorten(cause)}"


def _shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _tree_rss(pid: int) -> int:
    """The largest resident set among the job's processes (launcher, ranks, loader workers)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    peak = 0
    for proc in procs:
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.NoSuchProcess:
            continue
    return peak


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> bool:
    """Send `signum` to the job's process group; False when no process of it is left."""
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        return False
    return True


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float = 0.0) -> None:
    """End every process of the job's group: SIGTERM and up to `grace_s` to exit when `grace_s` > 0, then SIGKILL
    for whatever is left; returns once the job's own process is reaped."""
    if grace_s > 0 and _signal_group(proc, signal.SIGTERM):
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader: its zombie would keep the group alive
            if not _signal_group(proc, 0):
                break
            time.sleep(0.05)
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def _held_stop_signals() -> Iterator[list[int]]:
    """SIGINT and SIGTERM received inside the block, held (listed) instead of acted on; outside it, the handlers the
    process had. Only the main thread can set handlers (and only it receives signals): elsewhere nothing is held."""
    received: list[int] = []
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            handler = signal.getsignal(signum)
            if handler not in (signal.SIG_IGN, None):  # ignored stays ignored; None: set outside Python
                previous[signum] = handler
                signal.signal(signum, lambda got, _frame: received.append(got))
    try:
        yield received
    finally:
        for held, handler in previous.items():
            signal.signal(held, handler)


def run_job(
    command: Sequence[str],
    log_path: Path,
    *,
    timeout_s: float,
    rss_budget_bytes: int | None = None,
    env: Mapping[str, str] | None = None,
) -> JobOutcome:
    """Run `command` with stdout+stderr to `log_path`, in its own process group; kill it all on a timeout or when
    any of its processes passes `rss_budget_bytes` (None: RSS not watched). Never raises for the job's failures."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with _held_stop_signals() as stop, log_path.open("wb") as log:
        proc = subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: a kill reaches every rank
            env={**(env if env is not None else os.environ), "PYTHONUNBUFFERED": "1"},
        )
        try:
            killed, watched = _supervise(proc, stop, started, timeout_s, rss_budget_bytes)
        except BaseException:
            _stop_group(proc, STOP_GRACE_S)
            raise
        if stop:
            _stop_group(proc, STOP_GRACE_S)
    if stop:
        # The signal again, now to the process's own handler: KeyboardInterrupt for Ctrl-C, the end for SIGTERM. A
        # handler of the caller's may return: the job still ended because of it.
        signal.raise_signal(stop[0])
        killed = ("crash", f"stopped: its supervisor received {signal.Signals(stop[0]).name}")
    wall_s = time.perf_counter() - started
    if killed is not None:
        return JobOutcome(status=killed[0], reason=killed[1], returncode=None, wall_s=wall_s,
                          watched_peak_rss_bytes=watched, log_path=log_path)  # fmt: skip
    if proc.returncode != 0:
        status, reason = classify_failure(log_path.read_text(errors="replace"), proc.returncode)
        return JobOutcome(status=status, reason=reason, returncode=proc.returncode, wall_s=wall_s,
                          watched_peak_rss_bytes=watched, log_path=log_path)  # fmt: skip
    return JobOutcome(status="ok", reason="", returncode=0, wall_s=wall_s, watched_peak_rss_bytes=watched,
                      log_path=log_path)  # fmt: skip


def _supervise(
    proc: subprocess.Popen[bytes],
    stop: list[int],
    started: float,
    timeout_s: float,
    rss_budget_bytes: int | None,
) -> tuple[tuple[JobStatus, str] | None, int]:
    """Poll the job until it exits, a stop signal is held (`stop` not empty), its time is up or it passes the
    memory budget (both: killed here); (why it was killed or None, the largest RSS watched)."""
    watched = 0
    while proc.poll() is None and not stop:
        if time.perf_counter() - started > timeout_s:
            _stop_group(proc)
            return ("timeout", f"no result within {timeout_s:g} s; the job was killed"), watched
        if rss_budget_bytes is not None:
            watched = max(watched, _tree_rss(proc.pid))
            if watched > rss_budget_bytes:
                _stop_group(proc)
                return (
                    "oom",
                    f"memory budget exceeded: a process reached {watched / 2**30:.2f} GiB RSS "
                    f"> {rss_budget_bytes / 2**30:.2f} GiB; the job was killed",
                ), watched
        time.sleep(POLL_S)
    return None, watched
