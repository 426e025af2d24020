"""The `health` section of a run config: what watches a run for non-finite steps, loss spikes, hung ranks and
stragglers, and what it does about them (docs/health.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.config.numbers import check_number, check_positive, check_seconds

__all__ = ["MIN_SPIKE_WARMUP_STEPS", "SPIKE_POLICIES", "HealthConfig"]

SPIKE_POLICIES = ("off", "warn", "skip", "rollback")
SpikePolicy = Literal["off", "warn", "skip", "rollback"]
# The fewest values a spike is judged against: the MAD of one value is 0 (any rise is then "a spike"), and the
# median of two is moved by either; from 3 on, one outlier moves neither the median nor the MAD.
MIN_SPIKE_WARMUP_STEPS = 3


@dataclass(kw_only=True)
class HealthConfig:
    nonfinite_guard: bool = field(
        default=True,
        metadata={
            "help": "skip an optimizer step whose loss or gradient norm is NaN/Inf on any rank (all ranks agree): "
            "no update, no scheduler tick, the batch recorded and skipped on a resume"
        },
    )
    spike_policy: SpikePolicy = field(
        default="warn",
        metadata={
            "help": "a loss (or gradient norm) over median + spike_threshold_mads × MAD of the last "
            "spike_window_steps steps: off | warn (one line and a record) | skip (drop this step's update, as "
            "metaseq does) | rollback (restore the newest checkpoint before the spike, skip rollback_skip_batches "
            "batches from there, as PaLM does)"
        },
    )
    spike_threshold_mads: float = field(
        default=6.0,
        metadata={"help": "how many median absolute deviations above the running median is a spike"},
    )
    spike_window_steps: int = field(
        default=100, metadata={"help": "steps of loss history the running median and MAD are taken over"}
    )
    spike_warmup_steps: int = field(
        default=20,
        metadata={
            "help": f"steps of history needed before spikes are looked for (at least {MIN_SPIKE_WARMUP_STEPS}, "
            "at most spike_window_steps)"
        },
    )
    spike_on_grad_norm: bool = field(
        default=False,
        metadata={
            "help": "also look for spikes of the gradient norm (when it is computed); off by default: a small "
            "model's gradient norm crosses 6 MADs by itself (5 times in 600 steps of the default run)"
        },
    )
    rollback_skip_batches: int = field(
        default=200,
        metadata={
            "help": "batches a rollback skips, from the data step its checkpoint resumes at, and at least through the "
            "batch that spiked (PaLM skipped 200-500)"
        },
    )
    rollback_lr_scale: float = field(
        default=1.0,
        metadata={
            "help": "the learning rate is multiplied by this at each rollback, in (0, 1]; 1 = unchanged"
        },
    )
    max_rollbacks: int = field(
        default=3,
        metadata={
            "help": "rollbacks a run may make; one more spike stops it, saving nothing, with exit code 5 (not "
            "restartable: a restart would meet the same spike)"
        },
    )
    max_dropped_in_a_row: int = field(
        default=20,
        metadata={
            "help": "updates dropped in a row (non-finite or, under spike_policy skip, spikes) that stop the run, "
            "saving nothing, with exit code 5 (not restartable): the run has diverged or its loss level moved"
        },
    )
    rerun_check: bool = field(
        default=False,
        metadata={
            "help": "after a non-finite step or a spike, run the same step again from the same state and compare: "
            "a different result reports a suspected hardware fault (naming the rank), the same one a data or "
            "optimisation problem (naming the batch: shard and offsets); costs one more step per event"
        },
    )
    skip_batches: list[int] = field(
        default_factory=list,
        metadata={
            "help": "data-stream batches to skip, by index (0 = the first global batch); the run's own skips are "
            "kept in its checkpoints and need not be listed"
        },
    )
    watchdog: bool = field(
        default=True,
        metadata={
            "help": "per-rank heartbeat: a rank silent past its section's timeout dumps every rank's stacks to "
            "<out>/health/ and the run exits with a restartable code"
        },
    )
    setup_timeout_s: float = field(
        default=900.0,
        metadata={"help": "watchdog timeout before the first step (launch, data, compile), seconds"},
    )
    step_timeout_s: float | None = field(
        default=None,
        metadata={
            "help": "watchdog timeout of one step, seconds; null = 10 × the slowest of the first measured steps, "
            "at least 60"
        },
    )
    checkpoint_timeout_s: float = field(
        default=1800.0, metadata={"help": "watchdog timeout of one checkpoint save, seconds"}
    )
    validation_timeout_s: float = field(
        default=1800.0, metadata={"help": "watchdog timeout of one validation, seconds"}
    )
    collective_timeout_s: float = field(
        default=1800.0,
        metadata={
            "help": "the process group's timeout for one collective, seconds (torch's default is 1800)"
        },
    )
    stragglers: bool = field(
        default=True,
        metadata={
            "help": "name a rank whose own compute per step is over the median of all ranks by "
            "straggler_threshold for straggler_windows logging windows in a row (metrics, Prometheus, one line)"
        },
    )
    straggler_threshold: float = field(
        default=0.2,
        metadata={"help": "how far over the median a straggler's own compute per step is, as a fraction"},
    )
    straggler_windows: int = field(
        default=3, metadata={"help": "logging windows in a row a rank must be slow before it is named"}
    )

    def __post_init__(self) -> None:
        if self.spike_policy not in SPIKE_POLICIES:
            raise ConfigError(
                "spike_policy", f"must be one of {', '.join(SPIKE_POLICIES)}, got {self.spike_policy!r}"
            )
        check_positive("spike_threshold_mads", self.spike_threshold_mads)
        check_number("spike_threshold_mads", self.spike_threshold_mads, high=1e6)
        check_positive("straggler_threshold", self.straggler_threshold)
        check_number("straggler_threshold", self.straggler_threshold, high=1e6)
        check_positive("straggler_windows", self.straggler_windows)
        check_number("straggler_windows", self.straggler_windows, high=1_000_000)
        for name in ("spike_window_steps", "spike_warmup_steps"):
            check_positive(name, getattr(self, name))
        if self.spike_warmup_steps < MIN_SPIKE_WARMUP_STEPS:
            raise ConfigError(
                "spike_warmup_steps",
                f"must be at least {MIN_SPIKE_WARMUP_STEPS} (the median and MAD of fewer steps cannot tell a "
                f"spike: every rise would be one), got {self.spike_warmup_steps}",
            )
        if self.spike_warmup_steps > self.spike_window_steps:
            raise ConfigError(
                "spike_window_steps",
                f"must be at least spike_warmup_steps ({self.spike_warmup_steps}), got {self.spike_window_steps}",
            )
        check_positive("rollback_skip_batches", self.rollback_skip_batches)
        check_number("rollback_skip_batches", self.rollback_skip_batches, high=2**31 - 1)
        check_number("rollback_lr_scale", self.rollback_lr_scale, above=0.0, high=1.0)
        check_number("max_rollbacks", self.max_rollbacks, low=0, high=2**31 - 1)
        check_positive("max_dropped_in_a_row", self.max_dropped_in_a_row)
        check_number("max_dropped_in_a_row", self.max_dropped_in_a_row, high=2**31 - 1)
        for name in ("rollback_skip_batches", "max_rollbacks", "max_dropped_in_a_row"):
            if not isinstance(getattr(self, name), int):
                raise ConfigError(name, f"must be an integer, got {getattr(self, name)!r}")
        for name in (
            "setup_timeout_s",
            "checkpoint_timeout_s",
            "validation_timeout_s",
            "collective_timeout_s",
        ):
            check_seconds(name, getattr(self, name))
        if self.step_timeout_s is not None:
            check_seconds("step_timeout_s", self.step_timeout_s)
        bad = [b for b in self.skip_batches if isinstance(b, bool) or not isinstance(b, int) or b < 0]
        if bad:
            raise ConfigError("skip_batches", f"must be batch indices >= 0, got {bad[0]!r}")
        for index in self.skip_batches:
            check_number("skip_batches", index, low=0)  # within 64 bits
