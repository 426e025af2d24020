"""`gaudi3 health RUN` reads what the watchdog wrote (health.report): hang reports, each rank's last heartbeat, and
the training loop's top frames in the newest dump of each stacks file (faulthandler's, py-spy's)."""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.health.dumps import dump_header
from gaudi3_scale.health.heartbeat import Heartbeat, write_json_atomic
from gaudi3_scale.health.report import format_health, rank_stopped, read_health

GAUDI3 = [sys.executable, "-m", "gaudi3_scale.cli"]
BEAT = Heartbeat(
    rank=0, local_rank=0, pid=4242, host="node-a", parent_pid=1, attempt=0,
    main_thread_id=threading.main_thread().ident or 0, section="step", step=14, timeout_s=10.0,
    step_timeout_s=10.0, last_beat_unix_s=1_800_000_000.0, last_beat_monotonic_s=500.0,
    written_unix_s=1_800_000_001.0, written_monotonic_s=501.0,
)  # fmt: skip
# py-spy 0.4's `dump --nonblocking` layout (threads by Linux thread id; the main thread's is the pid)
PY_SPY = """Process 4343: python -m gaudi3_scale.train
Python v3.11.7 (/usr/bin/python3.11)

Thread 4350 (idle)
    _run (gaudi3_scale/health/watchdog.py:150)
Thread 4343 (idle)
    allreduce (torch/distributed/distributed_c10d.py:2950)
    training_step (gaudi3_scale/train/module.py:210)
"""


def waiting_in_allreduce(path: Path, header: str) -> None:
    with path.open("a") as file:
        file.write(header)
        file.flush()
        faulthandler.dump_traceback(file=file, all_threads=True)


def _run_dir(tmp_path: Path) -> Path:
    health = tmp_path / "run" / "health"
    health.mkdir(parents=True)
    write_json_atomic(health / "heartbeat-rank0.json", BEAT.to_dict())
    peer = dataclasses.replace(BEAT, rank=1, local_rank=1, pid=4343, last_beat_unix_s=1_799_999_999.0)
    write_json_atomic(health / "heartbeat-rank1.json", peer.to_dict())
    silent = {"rank": 1, "pid": 4343, "section": "step", "step": 14, "silent_s": 10.6, "timeout_s": 10.0,
              "reason": "its heartbeat stopped: the process is not running"}  # fmt: skip
    hang = {"detected_by_rank": 0, "detected_by_step": 15, "detected_unix_s": 1_800_000_010.0, "attempt": 0,
            "silent": [silent], "files": [], "exit_code": 143}  # fmt: skip
    write_json_atomic(health / "hang-rank0.json", hang)
    older = '--- rank 0, earlier: an older dump\nThread 0x1 (most recent call first):\n  File "old.py", line 1 in older\n'
    (health / "stacks-rank0.txt").write_text(older)
    waiting_in_allreduce(health / "stacks-rank0.txt", dump_header(0, "found by rank 0's watchdog"))
    (health / "stacks-rank1.txt").write_text(dump_header(1, "asked by rank 0 (SIGUSR2)"))  # stopped: no body
    (health / "py-spy-rank1.txt").write_text(PY_SPY)
    (health / "py-spy-rank0.txt").write_text("Error: Failed to find python version from target process\n")
    return tmp_path / "run"


def test_the_report_names_the_hang_and_each_ranks_newest_frames(tmp_path: Path) -> None:
    report = read_health(_run_dir(tmp_path))
    assert [r.rank for r in report.ranks] == [0, 1]
    own, stopped = report.ranks
    stacks, spy = own.dumps
    assert stacks.header is not None and "found by rank 0's watchdog" in stacks.header  # the newest dump only
    assert stacks.frames[0].startswith("waiting_in_allreduce (unit/test_health_report.py:")
    assert spy.frames == [] and spy.note == "py-spy failed: Failed to find python version from target process"
    asked, spied = stopped.dumps
    assert asked.frames == [] and asked.note is not None and "did not run again" in asked.note
    assert spied.frames == [
        "allreduce (distributed/distributed_c10d.py:2950)",
        "training_step (train/module.py:210)",
    ]

    lines = format_health(report)
    assert lines[1] == (
        "hang found by rank 0 at its step 15, 2027-01-15 08:00:10 UTC (attempt 0): rank 1 silent for 10.6 s in step "
        "at step 14 (timeout 10 s; its heartbeat stopped: the process is not running); exit 143 (restartable)"
    )
    assert lines[2].startswith("rank 0: pid 4242 on node-a, attempt 0: in step at step 14 (timeout 10 s); last beat "
                               "2027-01-15 08:00:00 UTC")  # fmt: skip
    assert "    allreduce (distributed/distributed_c10d.py:2950)" in lines


def test_a_finished_rank_and_a_run_without_hangs(tmp_path: Path) -> None:
    health = tmp_path / "health"
    health.mkdir()
    write_json_atomic(health / "heartbeat-rank0.json", dataclasses.replace(BEAT, section="done").to_dict())
    assert format_health(read_health(tmp_path))[1:] == [
        "no hang recorded",
        "rank 0: pid 4242 on node-a, attempt 0: finished (watchdog stopped) after step 14; last beat "
        "2027-01-15 08:00:00 UTC, heartbeat written 2027-01-15 08:00:01 UTC",
    ]


def test_a_directory_without_health_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="no health/ directory here"):
        read_health(tmp_path)
    done = subprocess.run([*GAUDI3, "health", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"gaudi3: error: {tmp_path}: no health/ directory here")
    assert done.stderr.count("\n") == 1
    # A path that is not there is a typo, not a run trained without the watchdog.
    done = subprocess.run([*GAUDI3, "health", str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"gaudi3: error: {tmp_path / 'nowhere'}: no such directory; pass the output directory of a run\n"
    )


def test_a_rank_killed_or_gone_silent_is_not_shown_as_training(tmp_path: Path) -> None:
    """What a kill -9 or the OOM killer leaves: a heartbeat that still says `in step`. On this host its pid is
    asked; a rank elsewhere is known by its file's age (its watchdog rewrites it every 2 s)."""
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()  # its pid is nobody's now
    health = tmp_path / "health"
    health.mkdir()
    now = time.time()
    here = dataclasses.replace(BEAT, pid=dead.pid, host=socket.gethostname(), last_beat_unix_s=now - 5,
                               written_unix_s=now - 3)  # fmt: skip
    elsewhere = dataclasses.replace(
        BEAT, rank=1, local_rank=1, last_beat_unix_s=now - 125, written_unix_s=now - 120
    )
    write_json_atomic(health / "heartbeat-rank0.json", here.to_dict())
    write_json_atomic(health / "heartbeat-rank1.json", elsewhere.to_dict())
    done = subprocess.run([*GAUDI3, "health", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rank0, rank1 = done.stdout.splitlines()[2:]
    assert re.search(r"in step at step 14 \(timeout 10 s\); .*; process not running \(killed or crashed\), "
                     r"heartbeat \d+ s old$", rank0), rank0  # fmt: skip
    assert re.search(r"; heartbeat 1[2-9]\d s old: stale, its watchdog stopped writing \(killed, crashed or "
                     r"frozen\)$", rank1), rank1  # fmt: skip
    # A live rank with a fresh file, and a finished one however old, are just what their heartbeat says.
    live = dataclasses.replace(here, pid=os.getpid(), written_unix_s=now - 1)
    assert rank_stopped(live, now) is None
    assert rank_stopped(dataclasses.replace(elsewhere, section="done"), now) is None
    assert rank_stopped(dataclasses.replace(live, written_unix_s=now - 7), now) == (
        "heartbeat 7 s old: stale, its watchdog stopped writing (killed, crashed or frozen)"
    )  # alive but frozen (the GIL held, or stopped with SIGSTOP)


def test_lines_of_metrics_jsonl_that_are_not_records_are_passed_over(tmp_path: Path) -> None:
    event = {"step": 3, "health_event": "loss_spike", "health_action": "skip", "detail": "loss 9 over 4"}
    (tmp_path / "metrics.jsonl").write_text(f'["health_event"]\n{json.dumps(event)}\n"health_event"\n')
    assert format_health(read_health(tmp_path))[-1] == "step 3: loss_spike (skip): loss 9 over 4"


def _damaged_run(tmp_path: Path) -> Path:
    """A run whose rank 0 is readable and whose other files are each damaged one way."""
    run = _run_dir(tmp_path)
    health = run / "health"
    (health / "hang-rank0.json").unlink()
    (health / "hang-rank0.json").mkdir()  # a directory where the hang report should be
    for rank, field_, value in [(1, "timeout_s", "60"), (2, "last_beat_unix_s", 1e20), (3, "rank", "3"),
                                (4, "last_beat_unix_s", float("nan"))]:  # fmt: skip
        beat = dataclasses.replace(BEAT, rank=rank).to_dict() | {field_: value}
        (health / f"heartbeat-rank{rank}.json").write_text(json.dumps(beat))  # NaN as JSON's NaN
    event = {"step": 3, "health_event": "nonfinite", "health_action": "skip", "detail": "loss nan"}
    (run / "metrics.jsonl").write_bytes(
        b'{"step": 1, "train_loss": 2.5}\n'
        + b'\xff\xfe{"health_event": "x"}\n'
        + json.dumps({**event, "rerun": {}}).encode()
        + b"\n"
        + json.dumps(event).encode()
        + b"\n"
    )
    return run


def test_damaged_files_are_one_line_each_and_the_rest_is_reported(tmp_path: Path) -> None:
    run = _damaged_run(tmp_path)
    health = run / "health"
    done = subprocess.run([*GAUDI3, "health", str(run)], capture_output=True, text=True)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith("damaged: ")] == [
        f"damaged: {run / 'metrics.jsonl'}: line 2: not UTF-8 text",
        f"damaged: {run / 'metrics.jsonl'}: line 3: the health event's rerun is {{}}, without a verdict",
        f"damaged: {health / 'hang-rank0.json'}: not a hang report (cannot be read: Is a directory)",
        f"damaged: {health / 'heartbeat-rank1.json'}: not a heartbeat (timeout_s is '60', not a finite number)",
        f"damaged: {health / 'heartbeat-rank2.json'}: not a heartbeat (last_beat_unix_s is 1e+20, not a time "
        "(seconds since 1970, before 2242))",
        f"damaged: {health / 'heartbeat-rank3.json'}: not a heartbeat (rank is '3', not a whole number ≥ 0)",
        f"damaged: {health / 'heartbeat-rank4.json'}: not a heartbeat (last_beat_unix_s is nan, not a time "
        "(seconds since 1970, before 2242))",
    ]
    assert "no readable hang report" in lines
    assert any(line.startswith("rank 0: pid 4242 on node-a") for line in lines)  # the readable rest
    assert "rank 1: heartbeat file damaged" in lines and "rank 2: heartbeat file damaged" in lines
    assert lines[-1] == "step 3: nonfinite (skip): loss nan"


def test_a_run_with_nothing_readable_is_one_line_and_exit_2(tmp_path: Path) -> None:
    health = tmp_path / "run" / "health"
    health.mkdir(parents=True)
    (health / "heartbeat-rank0.json").write_text(json.dumps(BEAT.to_dict() | {"pid": -1}))
    done = subprocess.run([*GAUDI3, "health", str(tmp_path / "run")], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        f"gaudi3: error: {tmp_path / 'run'}: nothing readable: {health / 'heartbeat-rank0.json'}: not a heartbeat "
        "(pid is -1, not a whole number ≥ 0)\n"
    )


def test_a_damaged_heartbeat_is_no_heartbeat_to_the_watchdog(tmp_path: Path) -> None:
    from gaudi3_scale.health.heartbeat import read_heartbeat

    path = tmp_path / "heartbeat-rank0.json"
    path.write_text(json.dumps(BEAT.to_dict() | {"last_beat_monotonic_s": "500"}))
    assert read_heartbeat(path) is None
    path.write_text(json.dumps(BEAT.to_dict()))
    assert read_heartbeat(path) == BEAT
