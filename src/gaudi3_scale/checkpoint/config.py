"""When checkpoints are written and which ones are kept: the full tier (everything a resume needs) and the light
tier (weights only, for export, serving and evaluation; never resumed)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gaudi3_scale.config.core import check_positive
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.config.numbers import check_seconds

__all__ = ["CHECKPOINTS_OFF", "CheckpointConfig", "checkpoints_off_overrides"]

# What a throwaway run (a tuning trial, a benchmark cell, a plan probe) sets, whatever the run's config says: no
# checkpoint at all, and off what acts only on checkpoints (which `enabled: false` refuses rather than ignores).
CHECKPOINTS_OFF = {"enabled": False, "light_every_steps": 0, "remote_url": ""}


def checkpoints_off_overrides(*, spike_policy: str = "warn") -> list[str]:
    """`CHECKPOINTS_OFF` as `gaudi3 train` flags, and what else a throwaway run of a config whose
    `health.spike_policy` is `spike_policy` must change: `rollback` restores a checkpoint (refused without one), so it
    warns instead (the same watch for spikes, nothing to restore)."""
    flags = [f"--checkpoint.{key}={str(value).lower()}" for key, value in CHECKPOINTS_OFF.items()]
    return flags + (["--health.spike_policy=warn"] if spike_policy == "rollback" else [])


@dataclass(kw_only=True)
class CheckpointConfig:
    enabled: bool = field(
        default=True,
        metadata={
            "help": "write checkpoints; false = none at all (benchmarks, tuning trials): nothing to resume"
        },
    )
    every_steps: int = field(
        default=500, metadata={"help": "save a checkpoint every N optimizer steps; 0 = only at the end"}
    )
    keep_last: int = field(default=3, metadata={"help": "keep the newest N committed checkpoints"})
    keep_every_steps: int = field(
        default=0, metadata={"help": "also keep every checkpoint whose step is a multiple of K; 0 = none"}
    )
    keep_best: int = field(
        default=0, metadata={"help": "also keep the N checkpoints with the lowest validation loss; 0 = none"}
    )
    light_every_steps: int = field(
        default=0,
        metadata={
            "help": "also save a light checkpoint (weights and run config only: exportable and servable, not "
            "resumable) every N optimizer steps into <out>/light_checkpoints/; a step due for a full checkpoint "
            "gets only the full one; 0 = off"
        },
    )
    light_keep_last: int = field(
        default=2,
        metadata={"help": "keep the newest N light checkpoints (full checkpoints keep their own retention)"},
    )
    async_save: bool = field(
        default=True,
        metadata={"help": "copy to host memory, then write in the background (single-file checkpoints)"},
    )

    remote_url: str = field(
        default="",
        metadata={
            "help": "also upload every committed full checkpoint to this fsspec URL (s3://, gs://, az://, file://, "
            "memory://) in the background; credentials and endpoint from the backend's environment variables"
        },
    )
    remote_max_backoff_s: float = field(
        default=60.0, metadata={"help": "longest wait between upload retries while the storage is failing"}
    )
    remote_drain_timeout_s: float = field(
        default=600.0, metadata={"help": "at the end of a run, wait this long for pending uploads"}
    )

    def __post_init__(self) -> None:
        check_positive("keep_last", self.keep_last)
        check_seconds("remote_max_backoff_s", self.remote_max_backoff_s)
        check_seconds("remote_drain_timeout_s", self.remote_drain_timeout_s, allow_zero=True)
        check_positive("light_keep_last", self.light_keep_last)
        for name in ("every_steps", "keep_every_steps", "keep_best", "light_every_steps"):
            check_positive(name, getattr(self, name), allow_zero=True)
        if not self.enabled:  # what only acts on checkpoints would be silently dropped
            for name, off in CHECKPOINTS_OFF.items():
                if getattr(self, name) != off:
                    raise ConfigError(
                        name,
                        f"{getattr(self, name)!r} would be ignored: checkpoint.enabled is false (no checkpoints)",
                    )
        light, full = self.light_every_steps, self.every_steps
        if light and full and light % full == 0:
            # Every light step would also be a full one, where the full checkpoint wins: no light one, ever.
            raise ConfigError(
                "light_every_steps",
                f"{light} is a multiple of checkpoint.every_steps ({full}), so every light checkpoint would fall "
                f"on a full one (which wins) and none would be written; use an interval below {full} (or any "
                "non-multiple), or 0 for no light checkpoints",
            )
