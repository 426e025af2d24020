"""What a hang leaves behind: Python stacks (faulthandler, in-process and on a signal), `py-spy dump` of each local
rank, and on CUDA PyTorch's NCCL flight recorder.

Stacks on request use SIGUSR2, not SIGUSR1: SIGUSR1 is a preemption signal of this project (the ranks save a
checkpoint and stop, `train.callbacks.GracefulInterrupt`), and a signal has one handler. faulthandler's handler
is C code that runs even while the main thread is blocked inside a collective; a stopped process runs it once
continued, so for a stopped rank `py-spy dump --nonblocking` (which reads its memory without pausing it) is what
shows the stacks.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

__all__ = [
    "DUMP_SIGNAL",
    "FLIGHT_RECORDER_ENV",
    "dump_flight_recorder",
    "dump_header",
    "dump_own_stacks",
    "find_py_spy",
    "flight_recorder_env",
    "py_spy_dump",
    "register_stack_dump",
    "request_stacks",
    "unregister_stack_dump",
]

DUMP_SIGNAL = signal.SIGUSR2
_PY_SPY_TIMEOUT_S = 30.0
# PyTorch's flight recorder, documented in "Flight Recorder for Debugging Stuck Jobs" (pytorch.org tutorials) and
# the ProcessGroupNCCL environment variables page: the ring buffer's entries, a dump when NCCL's own watchdog times
# out, and where the per-rank dump files go (prefix + rank). Read when the NCCL process group is created.
FLIGHT_RECORDER_ENV = (
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
)
_TRACE_BUFFER_ENTRIES = "2000"  # the tutorial's recommended size


def dump_header(rank: int, why: str) -> str:
    """The line that opens one dump in a stacks file: whose stacks, when, and why."""
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return f"--- rank {rank}, {when}: {why}\n"


def register_stack_dump(path: Path) -> IO[str]:
    """From now on DUMP_SIGNAL writes every thread's stack to `path` (appended); returns the open file, which
    must stay open until `unregister_stack_dump`."""
    file = path.open("a")
    faulthandler.register(DUMP_SIGNAL, file=file, all_threads=True, chain=False)
    return file


def unregister_stack_dump(file: IO[str]) -> None:
    faulthandler.unregister(DUMP_SIGNAL)
    file.close()


def dump_own_stacks(file: IO[str], header: str) -> None:
    file.write(header)
    file.flush()
    faulthandler.dump_traceback(file=file, all_threads=True)
    file.flush()


def request_stacks(pid: int, path: Path, header: str) -> None:
    """Ask process `pid` (a local rank) for its stacks: the header goes first, its faulthandler appends the rest.
    A stopped process writes them only if it is ever continued."""
    with path.open("a") as file:
        file.write(header)
    os.kill(pid, DUMP_SIGNAL)


def find_py_spy() -> str | None:
    """py-spy on PATH, or beside this interpreter (a virtual environment's bin/, which a launched worker's PATH may
    not hold). Installed by the `health` extra."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.is_file() else None)


def py_spy_dump(py_spy: str, pid: int, path: Path) -> bool:
    """`py-spy dump --nonblocking --pid PID` into `path` (its output, or its error); False when another rank already
    wrote it (two ranks that found the same hang dump each process once)."""
    try:
        file = path.open("x")
    except FileExistsError:
        return False
    with file:
        try:
            done = subprocess.run(
                [py_spy, "dump", "--nonblocking", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=_PY_SPY_TIMEOUT_S,
            )
            file.write(
                done.stdout + done.stderr + (f"(py-spy exit {done.returncode})\n" if done.returncode else "")
            )
        except subprocess.TimeoutExpired:
            file.write(f"(py-spy dump of pid {pid} took more than {_PY_SPY_TIMEOUT_S:g} s)\n")
    return True


def flight_recorder_env(health_dir: Path) -> dict[str, str]:
    """The flight recorder's settings for a CUDA run: dumps land in `health_dir` as nccl-trace-rank<N>."""
    values = (_TRACE_BUFFER_ENTRIES, "1", str(health_dir / "nccl-trace-rank"))
    return dict(zip(FLIGHT_RECORDER_ENV, values, strict=True))


def dump_flight_recorder(path: Path) -> bool:
    """This rank's flight recorder now, pickled into `path` (the on-demand API of PyTorch's tutorial); False when
    there is none (no NCCL process group, or a build without NCCL)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"):
        return False
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump is None:
        return False
    path.write_bytes(dump())
    return True
