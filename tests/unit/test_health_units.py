"""The health section's parts on their own: the spike statistic, the data stream's skip bookkeeping, what a
rollback carries over its checkpoint, the rollback counter, loss.png's event marks, and the section's bad input
refused by `gaudi3 train` with one line and exit 2 before anything is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gaudi3_scale.data.skips import BatchSkips
from gaudi3_scale.health.config import HealthConfig
from gaudi3_scale.health.guard import StepGuard
from gaudi3_scale.health.spike import SpikeDetector
from gaudi3_scale.train.rollback import guard_stop


def test_a_value_far_over_the_running_median_is_a_spike_and_stays_out_of_the_history() -> None:
    detector = SpikeDetector(window=8, warmup=4, threshold_mads=6.0)
    for value in (3.0, 3.1, 2.9, 3.05):
        assert detector.check(value) is None
    spike = detector.check(9.0)
    assert spike is not None and spike.median == pytest.approx(3.025) and spike.value == 9.0
    assert 9.0 not in detector.history  # one spike moves neither the median nor the MAD
    assert detector.check(3.2) is None  # an ordinary value after it is not a spike


def test_no_spike_is_called_during_the_warm_up_or_on_a_flat_history() -> None:
    detector = SpikeDetector(window=10, warmup=5, threshold_mads=6.0)
    assert [detector.check(v) for v in (1.0, 50.0, 1.0, 1.0)] == [None] * 4  # still warming up
    flat = SpikeDetector(window=10, warmup=3, threshold_mads=6.0)
    for _ in range(5):
        assert flat.check(2.0) is None
    assert flat.check(2.001) is None  # MAD 0: the spread's floor keeps a tiny change from being a spike
    assert flat.check(4.0) is not None


def test_the_detector_state_restores_the_same_decisions() -> None:
    a = SpikeDetector(window=6, warmup=3, threshold_mads=4.0)
    for value in (1.0, 1.2, 0.9, 1.1, 1.05):
        a.check(value)
    b = SpikeDetector(window=6, warmup=3, threshold_mads=4.0)
    b.load_state_dict(a.state_dict())
    assert [a.check(v) is None for v in (1.3, 3.0, 1.0)] == [b.check(v) is None for v in (1.3, 3.0, 1.0)]


def test_updates_dropped_in_a_row_stop_the_run_and_an_applied_one_resets_the_count() -> None:
    """A spike never joins the history and a skip leaves the weights as they were: once the loss level moves, every
    update is a spike, for ever. health.max_dropped_in_a_row stops it, with a non-restartable exit code."""
    cfg = HealthConfig(
        spike_policy="skip", spike_window_steps=3, spike_warmup_steps=3, max_dropped_in_a_row=3
    )
    guard = StepGuard(cfg, BatchSkips())
    norm = torch.tensor(1.0)
    assert all(guard.check(step, torch.tensor(1.0 + 0.01 * step), norm) for step in range(3))
    assert [guard.check(3, torch.tensor(5.0), norm) for _ in range(2)] == [False, False]
    assert guard.check(3, torch.tensor(1.0), norm)  # applied: the count starts again
    assert guard.dropped_in_a_row == 0
    assert [guard.check(4, torch.tensor(5.0), norm) for _ in range(3)] == [False] * 3
    assert (guard.stop_at, guard.dropped_in_a_row, guard.skips.dropped) == (4, 3, [3, 4, 6, 7, 8])
    stop = guard_stop(guard)
    assert stop["stop_exit_code"] == 5 and stop["stop_reason"] == (
        "3 updates in a row dropped at step 4 for loss spikes (health.max_dropped_in_a_row), data batches 6–8"
    )
    assert "health.spike_policy warn" in stop["stop_hint"]


def test_skips_count_the_stream_past_skipped_and_dropped_batches() -> None:
    skips = BatchSkips([2, 3, 7])
    assert [skips.data_step_of_load(n) for n in range(6)] == [0, 1, 4, 5, 6, 8]
    assert skips.next_data_step(0) == 0 and skips.next_data_step(2) == 4
    assert skips.drop(2) == 4  # update 2 was to come from data step 4: dropped
    assert skips.next_data_step(2) == 5  # the same update count now loads the next batch
    restored = BatchSkips([11])
    restored.load_state_dict(skips.state_dict())
    assert restored.skipped == [2, 3, 7, 11] and restored.dropped == [4]
    assert restored.next_data_step(2) == 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--health.spike_threshold_mads", "0"], "health.spike_threshold_mads: must be > 0, got 0"),
        (["--health.spike_threshold_mads", "nan"], "health.spike_threshold_mads"),
        (
            ["--health.spike_policy", "rollback-now"],
            "health.spike_policy: got 'rollback-now'; allowed: off, warn, skip, rollback",
        ),
        (
            ["--health.spike_window_steps", "5"],
            "health.spike_window_steps: must be at least spike_warmup_steps (20)",
        ),
        (
            ["--health.spike_window_steps", "1", "--health.spike_warmup_steps", "1"],
            "health.spike_warmup_steps: must be at least 3 (the median and MAD of fewer steps cannot tell a spike",
        ),
        (["--health.max_dropped_in_a_row", "0"], "health.max_dropped_in_a_row: must be > 0, got 0"),
        (["--health.skip_batches", "[-1]"], "health.skip_batches: must be batch indices >= 0, got -1"),
        (
            ["--health.spike_policy", "rollback", "--checkpoint.enabled", "false"],
            "health.spike_policy: rollback restores a checkpoint, but checkpoint.enabled is false",
        ),
        (["--health.rollback_skip_batches", "0"], "health.rollback_skip_batches: must be > 0, got 0"),
        (["--health.rollback_lr_scale", "0"], "health.rollback_lr_scale: must be > 0, got 0"),
        (["--health.rollback_lr_scale", "1.5"], "health.rollback_lr_scale: must be <= 1, got 1.5"),
        (["--health.rollback_lr_scale", "nan"], "health.rollback_lr_scale"),
        (["--health.max_rollbacks", "-1"], "health.max_rollbacks: must be >= 0, got -1"),
        (["--health.straggler_threshold", "0"], "health.straggler_threshold: must be > 0, got 0"),
        (["--health.straggler_threshold", "nan"], "health.straggler_threshold"),
        (["--health.straggler_windows", "0"], "health.straggler_windows: must be > 0, got 0"),
    ],
)
def test_bad_health_settings_get_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--no-progress", *args],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not out.exists()


def test_the_rollback_counter_starts_at_0_and_counts_rollback_records_only() -> None:
    from prometheus_client import CollectorRegistry

    from gaudi3_scale.monitor.prometheus import MetricsExporter

    registry = CollectorRegistry()
    exporter = MetricsExporter(registry, rank=0, run="r", tokens_per_step=1)
    labels = {"rank": "0", "run": "r"}
    assert registry.get_sample_value("gaudi3_health_rollbacks_total", labels) == 0.0
    exporter.observe({"step": 7, "health_event": "loss_spike", "health_action": "rollback"})
    exporter.observe({"step": 7, "health_event": "rollback", "health_action": "rollback", "to_step": 6})
    assert registry.get_sample_value("gaudi3_health_rollbacks_total", labels) == 1.0
    assert registry.get_sample_value("gaudi3_health_loss_spikes_total", labels) == 1.0
    assert registry.get_sample_value("gaudi3_health_dropped_updates_total", labels) == 0.0


def test_a_rollback_carries_the_run_counts_and_lr_factor_over_the_older_checkpoint() -> None:
    cfg = HealthConfig(spike_policy="rollback", rollback_lr_scale=0.5)
    spiked = StepGuard(cfg, BatchSkips())
    spiked.counts["loss_spike"] = 1
    older = StepGuard(
        cfg, BatchSkips()
    ).state_dict()  # the checkpoint predates the spike: no counts, factor 1
    guard = StepGuard(cfg, BatchSkips([6, 7, 8]))
    guard.carry_from(spiked, lr_scale=0.5)
    guard.load_state_dict(older)
    assert (guard.counts["loss_spike"], guard.counts["rollback"], guard.lr_scale) == (1, 1, 0.5)
    assert guard.skips.skipped == [6, 7, 8] and guard.state_dict()["lr_scale"] == 0.5


def test_loss_png_marks_the_health_events(tmp_path: Path) -> None:
    import matplotlib.image

    from gaudi3_scale.health.marks import event_mark
    from gaudi3_scale.train.report import plot_loss

    records = [{"step": s, "train_loss": 4.0 - 0.1 * s} for s in range(1, 8)]
    events = [
        {"step": 3, "health_event": "nonfinite", "health_action": "skip"},
        {"step": 5, "health_event": "loss_spike", "health_action": "warn"},
        {"step": 7, "health_event": "loss_spike", "health_action": "rollback"},
        {"step": 7, "health_event": "rollback", "health_action": "rollback", "to_step": 6},
    ]
    assert [event_mark(e) for e in events] == ["dropped", "spike", None, "rollback"]
    plain, marked = tmp_path / "plain.png", tmp_path / "marked.png"
    plot_loss(records, plain, title="t")
    plot_loss(records + events, marked, title="t")
    assert (matplotlib.image.imread(plain) != matplotlib.image.imread(marked)).any()
