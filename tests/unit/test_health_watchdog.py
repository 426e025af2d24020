"""The hang watchdog in real processes, without training: a rank silent past its step timeout, a stopped peer (SIGSTOP)
named and killed by the rank beside it, and a running rank's stacks taken on request. Stacks come from faulthandler
and from py-spy (a test dependency); the process ends with the restartable exit code. A 2-rank training run:
tests/distributed/test_hang_watchdog.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gaudi3_scale.distributed.launch import RESTARTABLE_EXIT_CODES
from gaudi3_scale.health.dumps import dump_header, request_stacks
from gaudi3_scale.health.heartbeat import read_heartbeat
from gaudi3_scale.health.watchdog import HANG_EXIT_CODE

GAUDI3 = [sys.executable, "-m", "gaudi3_scale.cli"]
STEP_TIMEOUT_S = 2.0
# A rank's training loop as the watchdog sees it: beats, then (rank 0, STALL=1) stuck in one call.
RANK = f"""
import os, sys, time
from pathlib import Path
from gaudi3_scale.health.config import HealthConfig
from gaudi3_scale.health.watchdog import Watchdog

rank, world = int(sys.argv[2]), int(sys.argv[3])
cfg = HealthConfig(step_timeout_s={STEP_TIMEOUT_S}, setup_timeout_s=30.0)
watchdog = Watchdog(cfg, Path(sys.argv[1]), rank=rank, local_rank=rank, local_world_size=world, warmup_steps=0)
watchdog.start().enter("step")

def stuck_in_a_collective():
    time.sleep(120)

def beat_forever(step):
    while True:
        time.sleep(0.05)
        step += 1
        watchdog.beat(step)
        if step == 5 and os.environ.get("STALL") == "1":
            stuck_in_a_collective()

beat_forever(0)
"""


def _start(script: Path, health: Path, rank: int, world: int, **env: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(script), str(health), str(rank), str(world)]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


def _wait_for_step(health: Path, rank: int, step: int, proc: subprocess.Popen[str]) -> int:
    """The rank's pid, once its heartbeat file shows `step` steps."""
    deadline = time.monotonic() + 60
    while True:
        beat = read_heartbeat(health / f"heartbeat-rank{rank}.json")
        if beat is not None and beat.step >= step:
            return beat.pid
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


def test_a_rank_silent_past_its_step_timeout_dumps_its_stacks_and_exits_restartable(tmp_path: Path) -> None:
    script, health = tmp_path / "rank.py", tmp_path / "run" / "health"
    script.write_text(RANK)
    proc = _start(script, health, 0, 1, STALL="1")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == HANG_EXIT_CODE and HANG_EXIT_CODE in RESTARTABLE_EXIT_CODES, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("gaudi3: hang: rank 0 silent for"), stderr
    assert "in step at step 5 (timeout 2 s; its own deadline passed)" in stderr

    hang = json.loads((health / "hang-rank0.json").read_text())
    [silent] = hang["silent"]
    assert (silent["rank"], silent["section"], silent["step"]) == (0, "step", 5)
    assert STEP_TIMEOUT_S < silent["silent_s"] < STEP_TIMEOUT_S + 2  # checked every second
    assert hang["exit_code"] == HANG_EXIT_CODE
    assert sorted(Path(f).name for f in hang["files"]) == ["py-spy-rank0.txt", "stacks-rank0.txt"]

    report = subprocess.run([*GAUDI3, "health", str(tmp_path / "run")], capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    assert lines[1].startswith("hang found by rank 0 at its step 5, ") and "rank 0 silent for" in lines[1]
    # The training loop's thread, innermost frame first, from faulthandler and from py-spy.
    stacks = lines.index(
        next(line for line in lines if line.strip().startswith(str(health / "stacks-rank0.txt")))
    )
    assert lines[stacks + 1].strip().startswith("stuck_in_a_collective (")
    spy = lines.index(f"  {health / 'py-spy-rank0.txt'}")
    assert lines[spy + 1].strip().startswith("stuck_in_a_collective (") and "rank.py:" in lines[spy + 1]


def test_a_stopped_rank_is_named_by_its_peer_which_dumps_it_with_py_spy(tmp_path: Path) -> None:
    """SIGSTOP stops a rank's watchdog thread with it: the other rank of the node notices its stale heartbeat,
    dumps it with py-spy (which reads a stopped process), asks for its faulthandler stacks (written once the rank
    runs again), and exits restartable."""
    script, health = tmp_path / "rank.py", tmp_path / "run" / "health"
    script.write_text(RANK)
    ranks = [_start(script, health, rank, 2) for rank in (0, 1)]
    try:
        pid = _wait_for_step(health, 1, 10, ranks[1])
        _wait_for_step(health, 0, 10, ranks[0])
        stopped_at = time.time()
        os.kill(pid, signal.SIGSTOP)
        _, stderr = ranks[0].communicate(timeout=60)
        assert ranks[0].returncode == HANG_EXIT_CODE, stderr
        assert "gaudi3: hang: rank 1 silent for" in stderr and "its heartbeat stopped" in stderr
        hang = json.loads((health / "hang-rank0.json").read_text())
        assert [s["rank"] for s in hang["silent"]] == [1]
        # A file is stale 6 s after its last write (3 writes missed), which came at most 2 s before the stop; the
        # step timeout (2 s) has passed by then. Checked every second.
        assert STEP_TIMEOUT_S < hang["detected_unix_s"] - stopped_at < 6 + 2
        spy = (health / "py-spy-rank1.txt").read_text()
        assert f"Thread {pid} " in spy and "beat_forever (" in spy, spy
        asked = (health / "stacks-rank1.txt").read_text()
        assert asked.startswith("--- rank 1, ") and "asked by rank 0 (SIGUSR2)" in asked
        assert "File " not in asked  # stopped: faulthandler never ran
        # Then killed by rank 0: a stopped process never acts on the SIGTERM torch's agent would send.
        assert ranks[1].wait(timeout=10) == -signal.SIGKILL
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def test_a_running_rank_asked_for_its_stacks_writes_them_under_the_askers_header(tmp_path: Path) -> None:
    """What a peer that is frozen but not stopped gets: DUMP_SIGNAL runs its faulthandler (registered by its
    watchdog), which appends every thread's stack to the file the asker opened with its header line."""
    script, health = tmp_path / "rank.py", tmp_path / "run" / "health"
    script.write_text(RANK)
    proc = _start(script, health, 0, 1)
    try:
        pid = _wait_for_step(health, 0, 5, proc)
        path = health / "stacks-rank0.txt"
        request_stacks(pid, path, dump_header(0, "asked by a test (SIGUSR2)"))
        deadline = time.monotonic() + 20
        while "beat_forever" not in path.read_text():
            assert time.monotonic() < deadline, path.read_text()
            time.sleep(0.05)
        text = path.read_text()
        assert text.index("asked by a test (SIGUSR2)") < text.index("beat_forever")
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("step_timeout_s", "0"),
        ("step_timeout_s", "nan"),
        ("collective_timeout_s", "-5"),
        ("checkpoint_timeout_s", "inf"),
    ],
)
def test_a_bad_watchdog_timeout_is_one_line_and_exit_2(name: str, value: str) -> None:
    done = subprocess.run([*GAUDI3, "train", "--print-config", f"--health.{name}", value],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"gaudi3: error: health.{name}: ") and done.stderr.count("\n") == 1
    assert done.stdout == ""
