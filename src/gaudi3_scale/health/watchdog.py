"""The hang watchdog: a per-rank heartbeat with section-aware timeouts (docs/health.md, "Hang watchdog").

The training loop calls `enter(section)` when it starts setup, steps, a checkpoint or a validation, and `beat(step)`
after each optimizer step: a monotonic clock read and two attribute writes, nothing else. A daemon thread per rank
writes `<run>/health/heartbeat-rank<N>.json` every few seconds and checks the deadlines (`health.deadlines`): its
own rank silent past its section's timeout, or a rank on this node whose heartbeat file stopped changing (a
stopped or frozen process stops its own watchdog too, so its peers must notice).

On a hang the rank that found it dumps its own stacks (faulthandler, every thread), asks each local peer for its
stacks (DUMP_SIGNAL), runs `py-spy dump` on every local rank where py-spy is installed, saves the NCCL flight
recorder on CUDA, writes `hang-rank<N>.json`, prints one line naming the silent rank, section and step, kills the
silent peers (SIGKILL: a stopped or frozen process never acts on the SIGTERM torch's agent sends, which would hold
the restart for the agent's 30 s grace), and ends the process with HANG_EXIT_CODE, which the launcher passes on as
restartable: `--max-restarts` (or Kubernetes) restarts the run from its last checkpoint. The process exits with
`os._exit`, from the watchdog thread: the main thread is stuck (that is the point), so nothing it would run on the
way out can be waited for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, NoReturn

from gaudi3_scale.distributed.launch import RESTARTABLE_EXIT_CODES, process_alive, signal_exit_code
from gaudi3_scale.health.config import HealthConfig
from gaudi3_scale.health.deadlines import (
    SECTIONS,
    Silence,
    StepTimeoutLearner,
    section_timeout_s,
    silent_ranks,
)
from gaudi3_scale.health.dumps import (
    DUMP_SIGNAL,
    dump_flight_recorder,
    dump_header,
    dump_own_stacks,
    find_py_spy,
    py_spy_dump,
    register_stack_dump,
    request_stacks,
    unregister_stack_dump,
)
from gaudi3_scale.health.heartbeat import (
    DONE,
    STALE_AFTER_S,
    WRITE_EVERY_S,
    Heartbeat,
    hang_path,
    heartbeat_path,
    py_spy_path,
    read_heartbeats,
    stacks_path,
    write_json_atomic,
)

__all__ = ["HANG_EXIT_CODE", "Watchdog"]

# 128 + SIGTERM, one of the launcher's RESTARTABLE_EXIT_CODES (and Kubeflow's retryable codes): the run restarts
# from its last committed checkpoint, as after a preemption.
HANG_EXIT_CODE = signal_exit_code(signal.SIGTERM)
assert HANG_EXIT_CODE in RESTARTABLE_EXIT_CODES
_CHECK_EVERY_S = 1.0  # deadlines are checked this often: detection is at most this late
# How long a silent peer has to write the stacks it was asked for, before it is killed.
_ASKED_STACKS_WAIT_S = 1.0


class Watchdog:
    """One rank's heartbeat and its deadline checks; `start()` before training, `stop()` after (module docstring)."""

    def __init__(
        self, cfg: HealthConfig, health_dir: Path, *, rank: int, local_rank: int, local_world_size: int,
        warmup_steps: int,
    ) -> None:  # fmt: skip
        self.cfg, self.health_dir = cfg, health_dir
        self.rank, self.local_rank, self.local_world_size = rank, local_rank, local_world_size
        self.section = "setup"
        self.step = 0
        self.last_beat_s = time.monotonic()
        self._learner = StepTimeoutLearner(cfg.step_timeout_s, warmup_steps=warmup_steps)
        self._learning = True
        # Who this rank is, as its heartbeat says; the ranks of one launch on one node share their parent (torchrun's
        # agent), so a heartbeat file left by another launch in the same run directory is never taken for a peer,
        # nor a failed attempt's.
        now_s = time.monotonic()
        self._me = Heartbeat(
            rank=rank, local_rank=local_rank, pid=os.getpid(), host=socket.gethostname(), parent_pid=os.getppid(),
            attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            main_thread_id=threading.main_thread().ident or 0, section=self.section, step=0, timeout_s=0.0,
            step_timeout_s=None, last_beat_unix_s=time.time(), last_beat_monotonic_s=now_s,
            written_unix_s=time.time(), written_monotonic_s=now_s,
        )  # fmt: skip
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._write_lock = threading.Lock()
        self._stacks_file: IO[str] | None = None
        self._write_failed = False
        # peer rank -> its stacks file's size once asked (the header only)
        self._asked_sizes: dict[int, int] = {}

    # ---- the training loop's side: cheap, no I/O per step -----------------------------------------------------
    def beat(self, step: int) -> None:
        """An optimizer step ended (`step` steps done)."""
        now = time.monotonic()
        if self._learning:  # only the first steps: until the step timeout is known
            self._learning = self._learner.observe(now - self.last_beat_s) is None
        self.step = step
        self.last_beat_s = now

    def enter(self, section: str) -> str:
        """Start `section` (one of SECTIONS) now; returns the section left. The heartbeat file is rewritten at
        once: a section change is rare, and a peer must not judge a long checkpoint by the step timeout."""
        assert section in SECTIONS, section
        previous = self.section
        self.last_beat_s = time.monotonic()  # first: a reader never pairs the new section with an old beat
        self.section = section
        if self._thread is not None:
            self._write(time.monotonic())
        return previous

    @contextmanager
    def watching(self, section: str) -> Iterator[None]:
        """`section` for the body's duration, then back to the section it interrupted."""
        previous = self.enter(section)
        try:
            yield
        finally:
            self.enter(previous)

    # ---- start / stop ------------------------------------------------------------------------------------------
    def start(self) -> Watchdog:
        self.health_dir.mkdir(parents=True, exist_ok=True)
        self._stacks_file = register_stack_dump(stacks_path(self.health_dir, self.rank))
        self._write(time.monotonic())
        self._thread = threading.Thread(target=self._run, name="gaudi3-health-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; the heartbeat file says `done`, so no peer waits on this rank any more."""
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join()
        self._thread = None
        self.section = DONE
        self._write(time.monotonic())
        if self._stacks_file is not None:
            unregister_stack_dump(self._stacks_file)
            self._stacks_file = None

    # ---- the watchdog thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        written = time.monotonic()
        while not self._stopping.wait(_CHECK_EVERY_S):
            now = time.monotonic()
            if now - written >= WRITE_EVERY_S:
                self._write(now)
                written = now
            silent = silent_ranks(self._heartbeat(now), self._local_peers(), now, stale_after_s=STALE_AFTER_S)
            if silent:
                self._stop_on_hang(silent)

    def _heartbeat(self, now_s: float) -> Heartbeat:
        section = self.section  # before the beat: `enter` writes the beat first (see there)
        last_beat_s, step, step_timeout_s = self.last_beat_s, self.step, self._learner.timeout_s
        timeout_s = section_timeout_s(self.cfg, section, step_timeout_s) if section in SECTIONS else 0.0
        unix_s = time.time()
        return dataclasses.replace(
            self._me, section=section, step=step, timeout_s=timeout_s, step_timeout_s=step_timeout_s,
            last_beat_unix_s=unix_s - (now_s - last_beat_s), last_beat_monotonic_s=last_beat_s,
            written_unix_s=unix_s, written_monotonic_s=now_s,
        )  # fmt: skip

    def _write(self, now_s: float) -> None:
        try:
            with self._write_lock:
                write_json_atomic(
                    heartbeat_path(self.health_dir, self.rank), self._heartbeat(now_s).to_dict()
                )
        except OSError as exc:  # a full disk must not stop training; the peers still see this rank's silence
            if not self._write_failed:
                self._write_failed = True
                _say(f"warning: rank {self.rank}: the heartbeat file could not be written ({exc}); retrying")

    def _local_peers(self) -> list[Heartbeat]:
        """The other ranks of this launch and attempt on this node, still running, with their latest heartbeat."""
        if self.local_world_size <= 1:
            return []
        me = self._me
        return [
            beat for rank, beat in read_heartbeats(self.health_dir).items()
            if rank != self.rank and beat.section != DONE and process_alive(beat.pid)
            and (beat.host, beat.parent_pid, beat.attempt) == (me.host, me.parent_pid, me.attempt)
        ]  # fmt: skip

    def _stop_on_hang(self, silent: list[Silence]) -> NoReturn:
        what = "; ".join(s.describe() for s in silent)
        detected_unix_s, step = time.time(), self.step
        files: list[str] = []
        try:
            names = ", ".join(f"rank {s.rank}" for s in silent)
            files = self._dump(
                f"rank {self.rank}'s watchdog found a hang ({names} silent) at its step {step}"
            )
        except Exception as exc:  # the run still stops: a hung rank must not stay up because a dump failed
            _say(f"warning: rank {self.rank}: dumping the stacks failed ({type(exc).__name__}: {exc})")
        report = {
            "detected_by_rank": self.rank, "detected_by_step": step, "detected_unix_s": detected_unix_s,
            "attempt": self._me.attempt, "silent": [vars(s) for s in silent],
            "files": files, "exit_code": HANG_EXIT_CODE,
            "py_spy": find_py_spy() or "not installed (pip install 'gaudi3-scale[health]')",
        }  # fmt: skip
        try:
            write_json_atomic(hang_path(self.health_dir, self.rank), report)
        except OSError as exc:
            _say(f"warning: rank {self.rank}: the hang report could not be written ({exc})")
        _say(
            f"hang: {what}; found by rank {self.rank} at its step {step}, stacks in {self.health_dir}/; "
            f"exit {HANG_EXIT_CODE} (restartable): `gaudi3 health {self.health_dir.parent}` shows what each rank "
            "was doing"
        )
        self._kill_silent_peers([s for s in silent if s.rank != self.rank])
        os._exit(HANG_EXIT_CODE)

    def _kill_silent_peers(self, peers: list[Silence]) -> None:
        """SIGKILL the silent peers (ranks of this launch and attempt on this node, `_local_peers`), after up to
        _ASKED_STACKS_WAIT_S for the stacks they were asked for: a frozen process's faulthandler writes at once, a
        stopped one never does."""
        deadline = time.monotonic() + _ASKED_STACKS_WAIT_S
        waiting = {p.rank: stacks_path(self.health_dir, p.rank) for p in peers if p.rank in self._asked_sizes}
        while waiting and time.monotonic() < deadline:
            waiting = {r: f for r, f in waiting.items() if _size(f) <= self._asked_sizes[r]}
            time.sleep(0.05)
        for peer in peers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(peer.pid, signal.SIGKILL)

    def _dump(self, why: str) -> list[str]:
        """Stacks of this rank (faulthandler) and of its local peers (on request and by py-spy), the flight
        recorder on NCCL; returns the files written."""
        assert self._stacks_file is not None
        own = stacks_path(self.health_dir, self.rank)
        dump_own_stacks(self._stacks_file, dump_header(self.rank, why))
        files = [own]
        peers = self._local_peers()
        for peer in peers:
            path = stacks_path(self.health_dir, peer.rank)
            try:
                request_stacks(
                    peer.pid, path, dump_header(peer.rank, f"asked by rank {self.rank} ({DUMP_SIGNAL.name})")
                )
            except ProcessLookupError:
                continue  # it ended meanwhile
            self._asked_sizes[peer.rank] = _size(path)
            files.append(path)
        py_spy = find_py_spy()
        if py_spy is not None:
            for rank, pid in [(self.rank, os.getpid()), *((p.rank, p.pid) for p in peers)]:
                if py_spy_dump(py_spy, pid, py_spy_path(self.health_dir, rank)):
                    files.append(py_spy_path(self.health_dir, rank))
        trace = self.health_dir / f"nccl-trace-rank{self.rank}.pkl"
        if dump_flight_recorder(trace):
            files.append(trace)
        return [str(f) for f in files]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _say(line: str) -> None:
    print(f"gaudi3: {line}", file=sys.stderr, flush=True)
