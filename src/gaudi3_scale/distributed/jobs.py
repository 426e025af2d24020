"""A training job run as a supervised subprocess: its own process group, a timeout, a memory budget, and a verdict.

The tuner's trials and the benchmark matrix's cells both launch `gaudi3 train` (the same CLI and launcher as any
run, several ranks included) through `run_job`, which never raises for what happens inside the job:

- ``oom``: the device's out-of-memory error in any rank's output (CUDA: ``CUDA out of memory`` /
  ``OutOfMemoryError``; CPU allocator: ``DefaultCPUAllocator: can't allocate memory`` / ``MemoryError``; Gaudi:
  ``MODULE:PT_DEVMEM Allocation failed``, the Intel Gaudi PyTorch bridge's device-memory error, e.g. as quoted in
  vllm-gaudi's calibration docs, "Troubleshooting"), a process's RSS over the memory budget (CPU: watched every
  0.2 s), or a SIGKILL we did not send (the kernel's OOM killer): of the launcher, or with several ranks of the
  rank the elastic agent reports as the first to fail. When one rank fails, the launcher stops the others, so the
  ranks agree by construction: the job is OOM if any rank ran out.
- ``timeout``: no exit within `timeout_s` (a hang, or far too slow): every process of the job is killed.
- ``crash``: any other non-zero exit; the reason is the failed rank's own error line when there is one (not a
  surviving rank's word that it lost a peer).

Every process of the job is its process group and its process tree: torch's elastic launcher starts each rank in
a session of its own, so a kill of the group alone would leave the ranks running (a hung rank takes its launcher's
death SIGTERM as "stop after this step", which never comes).

Stopping the supervisor stops the job first. The job runs in a session of its own, out of the terminal's reach, so
Ctrl-C's SIGINT reaches only the supervisor: while a job runs, SIGINT and SIGTERM are held, every process of the job
gets SIGTERM (the ranks' preemption signal), `STOP_GRACE_S` to exit and then SIGKILL, and only then does the
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
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import psutil

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
# The elastic agent's line for the first rank that failed (torch/distributed/elastic/multiprocessing/api.py):
# `failed (exitcode: -9) local_rank: 1 (pid: 9075) of binary: …`. With several ranks only it shows a rank's SIGKILL.
_RANK_KILLED = re.compile(rf"\bfailed \(exitcode: -{int(signal.SIGKILL)}\) local_rank: (\d+)")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")  # torch's prefix on a rank's uncaught exception's lines
# A surviving rank's line when another rank stopped (train.worker.stop_when_a_peer_is_lost): an effect, not a cause.
_PEER_LOST = "gaudi3: error: lost another rank"
POLL_S = 0.2
# SIGTERM to SIGKILL when the supervisor is stopped: time for the ranks to leave their step and exit cleanly
# (trials and benchmark cells write no checkpoint), short enough for a person waiting on Ctrl-C.
STOP_GRACE_S = 5.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long a stop waits for SIGKILLed processes to be gone (they are within milliseconds; a process stuck in the
# kernel, in uninterruptible sleep, is not waited for any longer).
KILLED_EXIT_S = 5.0


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
    """Why a job process failed, from its exit code and the (interleaved) output of all its ranks. Called only for
    a job that ended by itself: a job its supervisor killed has its verdict already (timeout, memory budget)."""
    for kind, pattern in OOM_PATTERNS.items():
        match = pattern.search(output)
        if match:
            line = next((ln for ln in output.splitlines() if match.group(0) in ln), match.group(0))
            return "oom", f"out of memory ({kind}): {_shorten(line.strip())}"
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return "oom", "killed by a SIGKILL its supervisor did not send (the kernel's OOM killer, most likely)"
    killed_rank = _RANK_KILLED.search(output)
    if killed_rank:
        return "oom", (
            f"local rank {killed_rank.group(1)} killed by a SIGKILL its supervisor did not send "
            "(the kernel's OOM killer, most likely)"
        )
    lines = [_RANK_PREFIX.sub("", ln.strip()) for ln in output.splitlines() if ln.strip()]
    # The rank's own cause beats the launcher's summary of it: our one-line errors first, then the last exception
    # line that is not the elastic agent reporting a failed child, then a surviving rank's word that it lost a peer
    # (the failed rank's own line is the cause, when it left one), then any error-looking line.
    own = [ln for ln in lines if ln.startswith("gaudi3: error:") and not ln.startswith(_PEER_LOST)]
    peer_lost = [ln for ln in lines if ln.startswith(_PEER_LOST)]
    exceptions = [ln for ln in lines if _EXCEPTION_LINE.match(ln) and "ChildFailedError" not in ln]
    errors = [ln for ln in lines if _ERROR_LINE.search(ln) and not _AGENT_REPORT.match(ln)]
    cause = own[:1] or exceptions[-1:] or peer_lost[:1] or errors[-1:] or lines[-1:]
    return (
        "crash",
        f"exit code {returncode}: {_shorten(cause[0] if cause else f'exit code {returncode}, no output')}",
    )


def _shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _tree_rss(pid: int) -> int:
    """The largest resident set among the job's processes (launcher, ranks, loader workers)."""
    import psutil

    peak = 0
    for proc in _job_processes(pid):
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.NoSuchProcess:
            continue
    return peak


def _job_processes(pid: int) -> list[psutil.Process]:
    """The job's process `pid` and all its descendants. torch's elastic launcher starts each rank in a session of
    its own, so the job's process group alone misses the ranks: they are found by parentage, while it still holds."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `procs` still running (a zombie waiting for its reaper has ended)."""
    import psutil

    left = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(proc)
        except psutil.NoSuchProcess:
            continue
    return left


def _signal_job(proc: subprocess.Popen[bytes], tree: list[psutil.Process], signum: int) -> None:
    """Send `signum` to the job's process group and to every process of `tree` (psutil checks that a pid was not
    reused since it was collected)."""
    import psutil

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signum)
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.send_signal(signum)


def _group_alive(proc: subprocess.Popen[bytes]) -> bool:
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float = 0.0) -> None:
    """End every process of the job: its process group and its process tree (collected before the first signal,
    as a killed launcher's ranks lose their parent). SIGTERM and up to `grace_s` to exit when `grace_s` > 0, then
    SIGKILL for whatever is left; returns once the job's own process is reaped and the rest has ended."""
    tree = _job_processes(proc.pid)
    if grace_s > 0:
        _signal_job(proc, tree, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader: its zombie would keep the group alive
            if not _group_alive(proc) and not _running(tree):
                break
            time.sleep(0.05)
        # a process started since the tree was collected (a rank's loader worker) is killed too
        started_since = [child for member in _running(tree) for child in _job_processes(member.pid)[1:]]
        tree += [child for child in started_since if child not in tree]
    _signal_job(proc, _running(tree), signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + KILLED_EXIT_S
    # the next job starts once this one's memory is free
    while _running(tree) and time.monotonic() < deadline:
        time.sleep(0.05)


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
