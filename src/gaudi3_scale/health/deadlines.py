"""When a rank is hung: the timeout of each section, the step timeout learnt from the first measured steps, and who
is silent given this rank's own heartbeat and its local peers' files. Pure functions on numbers and `Heartbeat`s,
so the rules are tested without a clock or a process.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from gaudi3_scale.health.config import HealthConfig
from gaudi3_scale.health.heartbeat import Heartbeat

__all__ = [
    "DERIVED_STEP_TIMEOUT_FACTOR",
    "MEASURED_STEPS",
    "MIN_DERIVED_STEP_TIMEOUT_S",
    "SECTIONS",
    "Silence",
    "StepTimeoutLearner",
    "section_timeout_s",
    "silent_ranks",
]

SECTIONS = ("setup", "step", "checkpoint", "validation")
# health.step_timeout_s null: 10 × the slowest of the first MEASURED_STEPS steps after the warm-up steps, at least
# 60 s (the config field's documented rule). Ten times leaves room for a slow batch, a GC pause, a noisy neighbour.
MEASURED_STEPS = 5
DERIVED_STEP_TIMEOUT_FACTOR = 10.0
MIN_DERIVED_STEP_TIMEOUT_S = 60.0


class StepTimeoutLearner:
    """The step timeout, once known: the configured one after the first step (the first step, with its data-loader
    start and compilation, is held to the setup timeout), or the derived one after `warmup_steps` + MEASURED_STEPS
    steps. `observe(interval_s)` takes the time between two beats; `timeout_s` is None until it is known."""

    def __init__(self, configured_s: float | None, *, warmup_steps: int) -> None:
        self.configured_s = configured_s
        self.warmup_steps = max(0, warmup_steps)
        self.steps_seen = 0
        self.measured_s: list[float] = []
        self.timeout_s: float | None = None

    def observe(self, interval_s: float) -> float | None:
        if self.timeout_s is not None:
            return self.timeout_s  # learnt once: later steps do not move it
        self.steps_seen += 1
        if self.configured_s is not None:
            self.timeout_s = self.configured_s
        elif self.steps_seen > self.warmup_steps:
            self.measured_s.append(interval_s)
            if len(self.measured_s) >= MEASURED_STEPS:
                self.timeout_s = max(
                    MIN_DERIVED_STEP_TIMEOUT_S, DERIVED_STEP_TIMEOUT_FACTOR * max(self.measured_s)
                )
        return self.timeout_s


def section_timeout_s(cfg: HealthConfig, section: str, step_timeout_s: float | None) -> float:
    """How long a rank may stay silent in `section`; steps whose timeout is not known yet have setup's."""
    if section == "step":
        return cfg.setup_timeout_s if step_timeout_s is None else step_timeout_s
    if section == "checkpoint":
        return cfg.checkpoint_timeout_s
    if section == "validation":
        return cfg.validation_timeout_s
    assert section == "setup", f"unknown watchdog section {section!r}"
    return cfg.setup_timeout_s


@dataclass(frozen=True)
class Silence:
    """Rank `rank` made no progress for `silent_s` in `section` at `step`, past its `timeout_s`. For a peer named
    by its stale file (`file_age_s`: how old that file is), `step` and `silent_s` are as of the file: the watchdog
    writes it every few seconds, so the rank may have done more steps after it and been silent that much less,
    which `describe` says."""

    rank: int
    pid: int
    section: str
    step: int
    silent_s: float
    timeout_s: float
    reason: str
    file_age_s: float | None = None  # None: the rank reported itself, its figures are current

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Silence:
        """A Silence read back from a hang report (`vars(silence)`; reports written before `file_age_s` lack it)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})

    def describe(self) -> str:
        if self.file_age_s is None:
            return (
                f"rank {self.rank} silent for {self.silent_s:.1f} s in {self.section} at step {self.step} "
                f"(timeout {self.timeout_s:g} s; {self.reason})"
            )
        return (
            f"rank {self.rank} silent for up to {self.silent_s:.1f} s in {self.section} at step {self.step} or a "
            f"later one (timeout {self.timeout_s:g} s; {self.reason}; figures from its heartbeat file, "
            f"{self.file_age_s:.1f} s old)"
        )


def _silence(beat: Heartbeat, now_s: float, reason: str) -> Silence:
    """`beat`'s silence now, as its figures say (`_stale_silence` for a stale peer's file, which may be behind)."""
    return Silence(beat.rank, beat.pid, beat.section, beat.step, beat.silent_s(now_s), beat.timeout_s, reason)


def _stale_silence(beat: Heartbeat, now_s: float) -> Silence:
    return replace(
        _silence(beat, now_s, "its heartbeat stopped: the process is not running"),
        file_age_s=now_s - beat.written_monotonic_s,
    )


def silent_ranks(
    own: Heartbeat, peers: list[Heartbeat], now_monotonic_s: float, *, stale_after_s: float
) -> list[Silence]:
    """The ranks to name as hung now, or [] while every rank is within its deadline.

    A peer whose file is stale (its watchdog thread has not written for `stale_after_s`: the process is stopped,
    or frozen with the GIL held) is hung once its own last beat is older than its own timeout. When this rank is
    past its deadline (typically waiting in a collective for a hung peer), a stale peer is named in its place even
    a moment before the peer's deadline: a rank whose watchdog still runs would have reported itself. With no stale
    peer, this rank names itself: its own stacks show where it waits.
    """
    stale = [p for p in peers if now_monotonic_s - p.written_monotonic_s > stale_after_s]
    hung = [_stale_silence(p, now_monotonic_s) for p in stale if p.silent_s(now_monotonic_s) > p.timeout_s]
    if hung:
        return hung
    if own.silent_s(now_monotonic_s) <= own.timeout_s:
        return []
    if stale:
        return [_stale_silence(p, now_monotonic_s) for p in stale]
    return [_silence(own, now_monotonic_s, "its own deadline passed")]
