"""Stopping a job's supervisor stops the job: `distributed.jobs.run_job` holds SIGINT and SIGTERM while its job runs,
ends the job's whole process group (SIGTERM, a grace, SIGKILL) and only then lets the signal take its course."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from process_groups import alive_in_group, kill_what_is_left

# A supervisor whose job is a shell that ignores SIGTERM (so only the SIGKILL after the grace ends it) with a child of
# its own (so the whole group must go, not only the process run_job started); the job writes both pids when running.
SUPERVISOR = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from gaudi3_scale.distributed import jobs

    jobs.STOP_GRACE_S = 0.5
    pids = sys.argv[1]
    job = ["sh", "-c", f"trap '' TERM; sleep 60 & echo $$ $! > {pids}.tmp; mv {pids}.tmp {pids}; wait"]
    jobs.run_job(job, Path(sys.argv[2]), timeout_s=60)
    print("run_job returned")
    """
)


def wait_for_file(path: Path, proc: subprocess.Popen[str], timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return path.read_text()


def _start_supervisor(tmp_path: Path, sigint: signal.Handlers) -> tuple[subprocess.Popen[str], Path]:
    """The supervisor process, with SIGINT as `sigint` when it starts; and the file its job writes its pids to."""
    pids = tmp_path / "pids"
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(pids), str(tmp_path / "job.log")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
    )
    return supervisor, pids


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_supervisor_stops_its_job_s_whole_process_group(
    tmp_path: Path, signum: signal.Signals
) -> None:
    supervisor, pids = _start_supervisor(tmp_path, signal.SIG_DFL)  # as from a terminal
    shell, sleeper = (int(pid) for pid in wait_for_file(pids, supervisor).split())
    assert os.getpgid(sleeper) == shell != os.getpgid(supervisor.pid)  # the job's own group
    supervisor.send_signal(signum)
    out, err = supervisor.communicate(timeout=60)
    assert supervisor.returncode == -signum, err  # SIGINT: a KeyboardInterrupt nobody caught ends it so too
    assert "run_job returned" not in out
    assert kill_what_is_left(shell) == [], "the job outlived its supervisor"
    if signum == signal.SIGINT:
        assert err.rstrip().endswith("KeyboardInterrupt"), err


def test_an_ignored_sigint_stays_ignored(tmp_path: Path) -> None:
    """A background job's SIGINT is ignored (`cmd &` in a script): the supervisor and its job run on."""
    supervisor, pids = _start_supervisor(tmp_path, signal.SIG_IGN)
    shell, _ = (int(pid) for pid in wait_for_file(pids, supervisor).split())
    supervisor.send_signal(signal.SIGINT)
    time.sleep(0.5)  # several of the supervisor's polls
    assert supervisor.poll() is None and alive_in_group(shell)
    os.killpg(shell, signal.SIGKILL)  # the job ends: run_job returns (a crash: SIGKILL)
    out, err = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 0 and "run_job returned" in out, err
