"""One tuning trial: a short real training run of one candidate, in its own process group, through `gaudi3 train`.

The trial launches exactly what training launches (the same CLI and launcher, several ranks included), on this one
node, with checkpoints and profiling off, a step logged every step, and `warmup_steps` (+3 with `torch.compile`, the
rule of `monitor.clock`) excluded from the measurement; step times come from the run's synchronised clock. Whatever
happens to it ends the trial, never the tuner: `distributed.jobs.run_job` supervises it (out of memory, crash,
timeout; see there), and on CPU the ranks' own peak RSS is checked against the budget at the end as well. A trial
that runs (one not reused from the cache) starts from an empty directory: the trainer appends to a metrics.jsonl it
finds, and an earlier run's steps (another config's, or a stopped tuner's) would be measured with this one's.
"""

from __future__ import annotations

import shutil
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from gaudi3_scale.config.core import from_dict
from gaudi3_scale.config.errors import ConfigError, brief
from gaudi3_scale.distributed.jobs import run_job
from gaudi3_scale.monitor.clock import COMPILE_WARMUP_STEPS
from gaudi3_scale.train.config import throwaway_run_overrides
from gaudi3_scale.train.report import read_metrics
from gaudi3_scale.tune.space import Candidate

__all__ = ["TrialResult", "TrialSettings", "run_trial"]

Status = Literal["ok", "oom", "crash", "timeout", "pruned", "skipped"]


@dataclass(frozen=True, kw_only=True)
class TrialSettings:
    world_size: int
    device: str
    warmup_steps: int = 2
    measure_steps: int = 5
    timeout_s: float = 300.0
    memory_budget_bytes: int | None = None
    spike_policy: str = "warn"  # the config's health.spike_policy (trials write no checkpoint)
    extra_overrides: tuple[str, ...] = ()

    def steps(self, candidate: Candidate) -> tuple[int, int]:
        """(steps excluded from the measurement, total steps)."""
        warmup = self.warmup_steps + (COMPILE_WARMUP_STEPS if candidate.compile else 0)
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
    def from_dict(cls, data: Any) -> TrialResult:
        """A result as `to_dict` wrote it; anything else is `ConfigError` naming the field (types checked the way
        config files are read)."""
        if not isinstance(data, dict):
            raise ConfigError("result", f"expected a mapping of fields, got {brief(data)}")
        return from_dict(cls, {k: v for k, v in data.items() if k != "key"}, prefix="result")


# One node, the trial's ranks, its own rendezvous on a free local port: a multi-node config's nodes are not there.
ONE_NODE = ("--parallel.nnodes=1", "--parallel.node_rank=0", "--parallel.rdzv_endpoint=null")


def _command(config_path: Path, candidate: Candidate, settings: TrialSettings, out: Path) -> list[str]:
    warmup, total = settings.steps(candidate)
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
        *ONE_NODE,
        *candidate.overrides(),
        f"--train.max_steps={total}",
        f"--train.throughput_warmup_steps={warmup}",
        "--train.log_every_steps=1",
        "--train.val_every_steps=0",
        "--train.val_batches=1",
        *throwaway_run_overrides(spike_policy=settings.spike_policy),
        *settings.extra_overrides,
    ]


def run_trial(
    config_path: Path,
    candidate: Candidate,
    settings: TrialSettings,
    trial_dir: Path,
    *,
    tokens_per_step: int,
    estimate_bytes: int | None = None,
) -> TrialResult:
    """Run one candidate for a short measured window in an emptied `trial_dir` (the tuner's: see the module's
    docstring); never raises for what happens inside the trial."""
    if trial_dir.exists():
        shutil.rmtree(trial_dir)
    out = trial_dir / "run"
    warmup, _ = settings.steps(candidate)
    budget = settings.memory_budget_bytes
    job = run_job(
        _command(config_path, candidate, settings, out),
        trial_dir / "train.log",
        timeout_s=settings.timeout_s,
        rss_budget_bytes=budget if settings.device == "cpu" else None,
    )
    result = TrialResult(
        candidate=candidate, status="crash", estimate_bytes=estimate_bytes, wall_s=job.wall_s
    )
    if job.status != "ok":
        result.status, result.reason = job.status, job.reason
        result.peak_memory_bytes = job.watched_peak_rss_bytes or None
        return result
    watched_peak = job.watched_peak_rss_bytes
    records = read_metrics(out / "metrics.jsonl")
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
