"""The watchdog's rules (health.deadlines): each section's timeout, the step timeout learnt from the first measured
steps, and who is named silent from this rank's heartbeat and its local peers'. The same rules run in real
processes in test_health_watchdog.py and tests/distributed/test_hang_watchdog.py."""

from __future__ import annotations

import dataclasses

import pytest

from gaudi3_scale.health.config import HealthConfig
from gaudi3_scale.health.deadlines import (
    MEASURED_STEPS,
    MIN_DERIVED_STEP_TIMEOUT_S,
    Silence,
    StepTimeoutLearner,
    section_timeout_s,
    silent_ranks,
)
from gaudi3_scale.health.heartbeat import Heartbeat

CFG = HealthConfig(setup_timeout_s=900, checkpoint_timeout_s=1200, validation_timeout_s=300)


def test_a_configured_step_timeout_holds_from_the_second_step() -> None:
    learner = StepTimeoutLearner(15.0, warmup_steps=3)
    assert learner.timeout_s is None  # the first step (compilation, the loader's start) has setup's timeout
    assert learner.observe(120.0) == 15.0
    assert section_timeout_s(CFG, "step", learner.timeout_s) == 15.0


def test_a_derived_step_timeout_is_ten_times_the_slowest_measured_step_after_the_warmup() -> None:
    learner = StepTimeoutLearner(None, warmup_steps=2)
    for interval in (500.0, 400.0):  # warm-up steps: not measured, however slow
        assert learner.observe(interval) is None
    for interval in [7.0, 9.5, 8.0, 8.2][: MEASURED_STEPS - 1]:
        assert learner.observe(interval) is None
    assert section_timeout_s(CFG, "step", learner.timeout_s) == 900  # not known yet: setup's
    assert learner.observe(8.1) == 95.0  # 10 × 9.5
    assert learner.observe(1000.0) == 95.0  # learnt once


def test_a_derived_step_timeout_is_at_least_sixty_seconds() -> None:
    learner = StepTimeoutLearner(None, warmup_steps=0)
    for _ in range(MEASURED_STEPS):
        learner.observe(0.02)
    assert learner.timeout_s == MIN_DERIVED_STEP_TIMEOUT_S == 60.0


@pytest.mark.parametrize(
    ("section", "expected"), [("setup", 900), ("checkpoint", 1200), ("validation", 300), ("step", 10)]
)
def test_each_section_has_its_timeout(section: str, expected: float) -> None:
    assert section_timeout_s(CFG, section, 10.0) == expected


def _beat(
    rank: int, *, last_beat: float, written: float, timeout: float = 10.0, section: str = "step"
) -> Heartbeat:
    return Heartbeat(
        rank=rank, local_rank=rank, pid=1000 + rank, host="node", parent_pid=1, attempt=0, main_thread_id=1,
        section=section, step=14, timeout_s=timeout, step_timeout_s=timeout, last_beat_unix_s=last_beat,
        last_beat_monotonic_s=last_beat, written_unix_s=written, written_monotonic_s=written,
    )  # fmt: skip


def test_everyone_within_the_deadline_is_not_a_hang() -> None:
    own = _beat(0, last_beat=95.0, written=100.0)
    peer = _beat(1, last_beat=96.0, written=99.0)
    assert silent_ranks(own, [peer], 100.0, stale_after_s=6.0) == []


def test_a_rank_past_its_own_deadline_with_live_peers_names_itself() -> None:
    own = _beat(0, last_beat=89.0, written=100.0)
    peer = _beat(
        1, last_beat=89.5, written=99.0
    )  # also waiting, but its watchdog still writes: it reports itself
    [silence] = silent_ranks(own, [peer], 100.0, stale_after_s=6.0)
    assert (silence.rank, silence.section, silence.step) == (0, "step", 14)
    assert silence.silent_s == pytest.approx(11.0) and silence.reason == "its own deadline passed"


def test_a_stopped_peer_is_named_instead_of_the_rank_waiting_for_it() -> None:
    """The peer's file stopped changing (its watchdog thread is stopped with it); this rank waits in the collective
    and passes its own deadline a moment before the peer's (its last beat came later)."""
    own = _beat(0, last_beat=89.9, written=100.0)
    peer = _beat(1, last_beat=90.1, written=91.0)
    [silence] = silent_ranks(own, [peer], 100.0, stale_after_s=6.0)
    assert silence.rank == 1 and silence.pid == 1001 and "not running" in silence.reason
    # Its figures are its file's, 9 s old: it may have stepped on after writing it (every few seconds).
    assert silence.describe() == (
        "rank 1 silent for up to 9.9 s in step at step 14 or a later one (timeout 10 s; its heartbeat stopped: the "
        "process is not running; figures from its heartbeat file, 9.0 s old)"
    )
    # A hang report keeps it (vars), and one written before file_age_s existed still reads
    assert Silence.from_record(vars(silence)) == silence
    old = {k: v for k, v in vars(silence).items() if k != "file_age_s"}
    assert (
        Silence.from_record(old).describe().startswith("rank 1 silent for 9.9 s in step at step 14 (timeout")
    )


def test_a_stopped_peer_is_named_once_past_its_own_timeout_while_this_rank_still_beats() -> None:
    own = _beat(0, last_beat=99.5, written=100.0)
    stopped = _beat(1, last_beat=88.0, written=89.0)
    assert [s.rank for s in silent_ranks(own, [stopped], 100.0, stale_after_s=6.0)] == [1]
    in_checkpoint = dataclasses.replace(stopped, section="checkpoint", timeout_s=1200.0)
    assert silent_ranks(own, [in_checkpoint], 100.0, stale_after_s=6.0) == []  # its section's timeout counts


def test_a_stale_file_alone_is_not_a_hang() -> None:
    """A peer whose watchdog thread was starved for a while but beat recently is not named."""
    own = _beat(0, last_beat=99.0, written=100.0)
    starved = _beat(1, last_beat=95.0, written=92.0)
    assert silent_ranks(own, [starved], 100.0, stale_after_s=6.0) == []
