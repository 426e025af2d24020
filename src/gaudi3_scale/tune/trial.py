"""One tuning trial: a short real training run of one candidate, in its own process group, through `gaudi3 train`.

The trial launches exactly what training launches (the same CLI and launcher, several ranks included), with
checkpoints off, a step logged every step, and `warmup_steps` (+2 with `torch.compile`) excluded from the
measurement. Whatever happens to it ends the trial, never the tuner:

- ``oom``: the device's out-of-memory error in any rank's output (CUDA: ``CUDA out of memory`` /
  ``OutOfMemoryError``; CPU allocator: ``DefaultCPUAllocator: can't allocate memory`` / ``MemoryError``; Gaudi:
  ``MODULE:PT_DEVMEM Allocation failed``, the Intel Gaudi PyTorch bridge's device-memory error, e.g. as quoted in
  vllm-gaudi's calibration docs, "Troubleshooting"), a rank's RSS over the memory budget (CPU: watched every
  0.2 s, and the ranks' own peak RSS checked at the end), or a SIGKILL we did not send (the kernel's OOM killer).
  When one rank fails, the launcher stops the others, so the ranks agree by construction: the trial is OOM if
  any rank ran out.
- ``timeout``: no exit within `timeout_s` (a hang, or far too slow): the whole process group is killed.
- ``crash``: any other non-zero exit; the reason is the last error line of the output.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from gaudi3_scale.tune.space import Candidate

__all__ = ["OOM_PATTERNS", "TrialResult", "TrialSettings", "classify_failure", "run_trial"]

Status = Literal["ok", "oom", "crash", "timeout", "pruned", "skipped"]

OOM_PATTERNS = {
    "cuda": re.compile(r"CUDA out of memory|OutOfMemoryError"),
    "cpu": re.compile(r"DefaultCPUAllocator: can't allocate memory|\bMemoryError\b|Cannot allocate memory"),
    "hpu": re.compile(r"MODULE:PT_DEVMEM Allocation failed|PT_DEVMEM"),
}
_ERROR_LINE = re.compile(r"(error|Error|Exception|Traceback|FAILED|Killed)")
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b[^:]*:")
_AGENT_REPORT = re.compile(r"^(error_file|traceback|exitcode|rank|host|time|root cause)\s*:")
POLL_S = 0.2


@dataclass(frozen=True, kw_only=True)
class TrialSettings:
    world_size: int
    device: str
    warmup_steps: int = 2
    measure_steps: int = 5
    timeout_s: float = 300.0
    memory_budget_bytes: int | None = None
    extra_overrides: tuple[str, ...] = ()

    def steps(self, candidate: Candidate) -> tuple[int, int]:
        """(steps excluded from the measurement, total steps)."""
        warmup = self.warmup_steps + (2 if candidate.compile else 0)
        return warmup, warmup + self.measure_steps


@dataclass(kw_only=True)
class TrialResult:
    candidate: Candidate
    status: Status
    reason: str = ""
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    peak_memory_bytes: int | None = None  # the largest rank's peak (CPU: RSS; CUDA: max allocated)
    estimate_bytes: int | None = None
    wall_s: float = 0.0
    measured_steps: list[int] = field(default_factory=list)

    @property
    def key(self) -> str:
        return self.candidate.key

    @property
    def ran(self) -> bool:
        return self.status not in ("pruned", "skipped")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["key"] = self.key
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        data = {k: v for k, v in data.items() if k != "key"}
        data["candidate"] = Candidate(**data["candidate"])
        return cls(**data)


def classify_failure(output: str, returncode: int) -> tuple[Status, str]:
    """Why a trial process failed, from its exit code and the (interleaved) output of all its ranks."""
    for kind, pattern in OOM_PATTERNS.items():
        match = pattern.search(output)
        if match:
            line = next((ln for ln in output.splitlines() if match.group(0) in ln), match.group(0))
            return "oom", f"out of memory ({kind}): {_shorten(line.strip())}"
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return "oom", "killed by SIGKILL that the tuner did not send (the kernel's OOM killer, most likely)"
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


def _command(config_path: Path, candidate: Candidate, settings: TrialSettings, out: Path) -> list[str]:
    _, total = settings.steps(candidate)
    return [
        sys.executable,
        "-m",
        "gaudi3_scale.cli",
        "train",
        "--config",
        str(config_path),
        "--out",
        str(out),
        "--resume",
        "never",
        "--no-progress",
        "--sample-tokens",
        "0",
        "--nproc-per-node",
        str(settings.world_size),
        *candidate.overrides(),
        f"--train.max_steps={total}",
        "--train.log_every_steps=1",
        "--train.val_every_steps=0",
        "--train.val_batches=1",
        "--checkpoint.enabled=false",
        *settings.extra_overrides,
    ]


def _tree_rss(pid: int) -> int:
    """The largest resident set among the trial's processes (launcher, ranks, loader workers)."""
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


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_trial(
    config_path: Path,
    candidate: Candidate,
    settings: TrialSettings,
    trial_dir: Path,
    *,
    tokens_per_step: int,
    estimate_bytes: int | None = None,
) -> TrialResult:
    """Run one candidate for a short measured window; never raises for what happens inside the trial."""
    trial_dir.mkdir(parents=True, exist_ok=True)
    out = trial_dir / "run"
    log_path = trial_dir / "train.log"
    warmup, _ = settings.steps(candidate)
    budget = settings.memory_budget_bytes
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    status: Status | None = None
    reason = ""
    watched_peak = 0
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            _command(config_path, candidate, settings, out),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: a kill reaches every rank
            env=env,
        )
        while proc.poll() is None:
            if time.perf_counter() - started > settings.timeout_s:
                _kill_group(proc)
                status, reason = "timeout", f"no result within {settings.timeout_s:g} s; the trial was killed"
                break
            if settings.device == "cpu" and budget is not None:
                watched_peak = max(watched_peak, _tree_rss(proc.pid))
                if watched_peak > budget:
                    _kill_group(proc)
                    status, reason = (
                        "oom",
                        (
                            f"memory budget exceeded: a process reached {watched_peak / 2**30:.2f} GiB RSS "
                            f"> {budget / 2**30:.2f} GiB; the trial was killed"
                        ),
                    )
                    break
            time.sleep(POLL_S)
    wall_s = time.perf_counter() - started
    result = TrialResult(candidate=candidate, status="crash", estimate_bytes=estimate_bytes, wall_s=wall_s)
    if status is not None:
        result.status, result.reason = status, reason
        result.peak_memory_bytes = watched_peak or None
        return result
    output = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        result.status, result.reason = classify_failure(output, proc.returncode)
        result.peak_memory_bytes = watched_peak or None
        return result
    records = _read_jsonl(out / "metrics.jsonl")
    steps = [r for r in records if r.get("train_loss") is not None and r.get("step_time_s")]
    measured = [r for r in steps if r["step"] > warmup]
    peaks = [int(r.get("peak_memory_bytes") or 0) for r in steps]
    result.peak_memory_bytes = max([*peaks, watched_peak]) or None
    if not measured:
        result.reason = f"exit code 0 but no measured steps after the {warmup} warm-up steps in metrics.jsonl"
        return result
    if budget is not None and result.peak_memory_bytes and result.peak_memory_bytes > budget:
        result.status = "oom"
        result.reason = (
            f"memory budget exceeded: peak {result.peak_memory_bytes / 2**30:.2f} GiB "
            f"> {budget / 2**30:.2f} GiB"
        )
        return result
    step_time_s = statistics.median(r["step_time_s"] for r in measured)
    result.status = "ok"
    result.step_time_s = step_time_s
    result.tokens_per_s = tokens_per_step / step_time_s
    result.measured_steps = [r["step"] for r in measured]
    result.reason = f"median of {len(measured)} steps after {warmup} warm-up"
    return result


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    import json

    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
