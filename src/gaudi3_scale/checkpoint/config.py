"""When checkpoints are written and which ones are kept."""

from __future__ import annotations

from dataclasses import dataclass, field

from gaudi3_scale.config.core import check_positive
from gaudi3_scale.config.numbers import check_seconds

__all__ = ["CheckpointConfig"]


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
    async_save: bool = field(
        default=True,
        metadata={"help": "copy to host memory, then write in the background (single-file checkpoints)"},
    )

    remote_url: str = field(
        default="",
        metadata={
            "help": "also upload every committed checkpoint to this fsspec URL (s3://, gs://, az://, file://, "
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
        for name in ("every_steps", "keep_every_steps", "keep_best"):
            check_positive(name, getattr(self, name), allow_zero=True)
