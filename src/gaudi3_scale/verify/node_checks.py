"""`gaudi3 doctor`'s host checks: /dev/shm, the open-file limit, free disk at the output directory, and clock
synchronisation (Linux). Thresholds and their reasons: docs/doctor.md.

Each `check_*` reads the machine and hands the readings to a `*_finding` function that judges them; the judging
functions take plain values, so tests feed them real readings (and readings of other machines' shapes).
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import sys
import tempfile
from pathlib import Path

from gaudi3_scale.verify.finding import DoctorInputs, Finding, fail, ok, size_text, warn

__all__ = [
    "NOFILE_MIN",
    "SHM_MIN_BYTES",
    "check_clock",
    "check_disk",
    "check_nofile",
    "check_shm",
    "clock_finding",
    "disk_finding",
    "nofile_finding",
    "read_kernel_clock",
    "shm_finding",
    "write_problem",
]

# NCCL's troubleshooting guide ("Shared memory"): NCCL fails to initialize without enough /dev/shm, and in Docker
# it asks for `--shm-size=1g --ulimit memlock=-1`; Docker's own default /dev/shm is 64 MiB.
SHM_MIN_BYTES = 2**30
# Our choice: 1024, the usual default soft limit (systemd >= 240: DefaultLimitNOFILE=1024:524288), runs out
# with ranks × DataLoader workers sharing tensors by file descriptor (torch.multiprocessing's default strategy),
# NCCL's sockets and sharded checkpoint files; 65536 leaves room for all of them.
NOFILE_MIN = 65536
# A checkpoint holds the weights and AdamW's two moments, in the parameters' dtype: 3 × 4 bytes per parameter in
# fp32 (the "K = 12" of the ZeRO paper, Rajbhandari et al. 2020, §3.1, for mixed-precision Adam), 3 × 2 in bf16-true.
TENSORS_PER_PARAM = 3


# ---- shared memory and limits ---------------------------------------------------------------------------------


def shm_finding(path: str = "/dev/shm") -> Finding:
    fix = "docker run --shm-size=1g (or --ipc=host); Kubernetes: an emptyDir with medium: Memory at /dev/shm"
    try:
        stat = os.statvfs(path)
    except OSError as exc:
        return fail("shm", f"{path}: {exc.strerror}: NCCL and DataLoader workers need shared memory", fix)
    size, free = stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
    found = f"{path} {size_text(size)} ({size_text(free)} free)"
    if size < SHM_MIN_BYTES:
        return warn(
            "shm",
            f"{found}, below {size_text(SHM_MIN_BYTES)}: NCCL may fail to initialize and DataLoader "
            "workers die with bus errors",
            fix,
        )
    return ok("shm", found)


def check_shm(inputs: DoctorInputs) -> Finding:
    return shm_finding()


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else f"{value:,}"


def nofile_finding(soft: int, hard: int) -> Finding:
    found = f"open files: soft {_limit(soft)}, hard {_limit(hard)}"
    if soft == resource.RLIM_INFINITY or soft >= NOFILE_MIN:
        return ok("nofile", found)
    if hard == resource.RLIM_INFINITY or hard >= NOFILE_MIN:
        fix = f"ulimit -n {NOFILE_MIN} before training (up to the hard limit needs no privilege)"
    else:
        fix = f"raise the hard limit: docker run --ulimit nofile={NOFILE_MIN}:{NOFILE_MIN}, systemd LimitNOFILE={NOFILE_MIN}"
    return warn(
        "nofile", f"{found}, below {NOFILE_MIN:,}: 'Too many open files' with many ranks or workers", fix
    )


def check_nofile(inputs: DoctorInputs) -> Finding:
    return nofile_finding(*resource.getrlimit(resource.RLIMIT_NOFILE))


# ---- disk -----------------------------------------------------------------------------------------------------


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def write_problem(directory: Path) -> str | None:
    """Why a run could not write under `directory` (created if missing, so its nearest existing parent is
    tried), or None; a real file is written and removed."""
    target = directory if directory.is_dir() else _nearest_existing(directory)
    if not target.is_dir():
        return f"{target} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=target, prefix=".gaudi3-doctor-"):
            pass
    except OSError as exc:
        return f"cannot write in {target} ({exc.strerror or exc})"
    return None


def _checkpoint_bytes(inputs: DoctorInputs) -> int:
    """A lower bound on one checkpoint's size; the vocabulary is unknown until the data is prepared, so the
    embedding tables are then counted at one row."""
    from gaudi3_scale.models.counting import count_parameters

    model, precision = inputs.cfg.model, inputs.cfg.train.precision
    params = count_parameters(model if model.vocab_size else model.resolve_vocab(1))
    return params * TENSORS_PER_PARAM * (2 if precision == "bf16-true" else 4)


def disk_finding(directory: Path, checkpoint_bytes: int, keep: int) -> Finding:
    """FAIL below one checkpoint (the next save fails), WARN below `keep` of them (the rotation's peak)."""
    problem = write_problem(directory)
    if problem is not None:
        return fail("disk", problem, "mount a writable volume there, or set --out to a writable directory")
    free = shutil.disk_usage(_nearest_existing(directory)).free
    found = f"{size_text(free)} free at {directory}"
    if not checkpoint_bytes:
        return ok("disk", f"{found}; writable; no checkpoints are written")
    need = f"one checkpoint is at least {size_text(checkpoint_bytes)}"
    fix = "free space, mount a larger volume, or lower checkpoint.keep_last"
    if free < checkpoint_bytes:
        return fail("disk", f"{found}; {need}: the first save would fail", fix)
    if free < checkpoint_bytes * keep:
        return warn(
            "disk", f"{found}; {need}, and {keep} exist at once (keep_last + the one being written)", fix
        )
    room = free // checkpoint_bytes
    return ok("disk", f"{found}; writable; {need}: room for {room:,}, {keep} needed at once")


def check_disk(inputs: DoctorInputs) -> Finding:
    ckpt = inputs.cfg.checkpoint
    size = _checkpoint_bytes(inputs) if ckpt.enabled else 0
    return disk_finding(inputs.cfg.output_dir, size, ckpt.keep_last + 1)


# ---- clock ----------------------------------------------------------------------------------------------------


class _Timex(ctypes.Structure):
    """Linux `struct timex` (adjtimex(2)); the trailing ints are the kernel's reserved padding."""

    _fields_ = [
        ("modes", ctypes.c_uint), ("offset", ctypes.c_long), ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long), ("esterror", ctypes.c_long), ("status", ctypes.c_int),
        ("constant", ctypes.c_long), ("precision", ctypes.c_long), ("tolerance", ctypes.c_long),
        ("time_sec", ctypes.c_long), ("time_usec", ctypes.c_long), ("tick", ctypes.c_long),
        ("ppsfreq", ctypes.c_long), ("jitter", ctypes.c_long), ("shift", ctypes.c_int),
        ("stabil", ctypes.c_long), ("jitcnt", ctypes.c_long), ("calcnt", ctypes.c_long),
        ("errcnt", ctypes.c_long), ("stbcnt", ctypes.c_long), ("tai", ctypes.c_int),
        ("reserved", ctypes.c_int * 11),
    ]  # fmt: skip


TIME_ERROR = 5  # adjtimex's return value when the clock is not synchronised (adjtimex(2))
STA_UNSYNC = 0x0040


def read_kernel_clock() -> tuple[int, int, int]:
    """(state, status bits, maximum error in µs) from adjtimex with modes 0: a read that needs no privilege and
    that containers may make (they share the host's clock, which is the one that matters). OSError if refused."""
    if not sys.platform.startswith("linux"):
        raise OSError(f"adjtimex is Linux only (this is {sys.platform})")
    libc = ctypes.CDLL(None, use_errno=True)
    timex = _Timex()
    state = libc.adjtimex(ctypes.byref(timex))
    if state < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return int(state), int(timex.status), int(timex.maxerror)


def clock_finding(state: int, status: int, maxerror_us: int) -> Finding:
    found = f"kernel clock state {state}, maximum error {maxerror_us / 1e3:,.1f} ms"
    if state == TIME_ERROR or status & STA_UNSYNC:
        return warn(
            "clock",
            f"not synchronised ({found}): logs of different nodes do not line up, and object "
            "stores refuse requests signed too far off their time (S3: RequestTimeTooSkewed)",
            "run chrony, ntpd or systemd-timesyncd on the host (a container uses the host's clock)",
        )
    return ok("clock", f"synchronised ({found})")


def check_clock(inputs: DoctorInputs) -> Finding:
    try:
        return clock_finding(*read_kernel_clock())
    except (OSError, AttributeError) as exc:  # AttributeError: a libc without adjtimex
        return warn(
            "clock",
            f"unknown: adjtimex failed ({exc})",
            "check the host: timedatectl show -p NTPSynchronized, or chronyc tracking",
        )
