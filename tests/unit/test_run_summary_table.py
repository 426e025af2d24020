"""The end-of-run table (`train.report.print_summary`) shows `gaudi3 plan`'s prediction beside each measured value
with its error; a steady-state prediction is not held against a mean over warm-up steps (a resumed run whose steps
were all warm-up showed "-92%" for a forecast that was right)."""

from __future__ import annotations

from rich.console import Console

from gaudi3_scale.train.report import print_summary

SUMMARY = {"name": "r", "steps": 4, "step_time_s": 1.0, "tokens_per_s": 500.0, "wall_s": 10.0, "measured_steps": 2,
           "predicted_step_time_s": 0.5, "predicted_tokens_per_s": 1000.0, "predicted_wall_s": 12.5}  # fmt: skip


def _table(summary: dict) -> str:
    console = Console(record=True, width=200)
    print_summary(summary, console=console)
    return console.export_text()


def test_predictions_of_steady_steps_are_compared_only_with_steady_steps() -> None:
    steady = _table({**SUMMARY, "throughput_includes_warmup": False})
    assert "1 (predicted 0.5, -50%)" in steady and "500 (predicted 1,000, +100%)" in steady
    warm = _table({**SUMMARY, "throughput_includes_warmup": True})
    assert "(predicted 0.5 for steady steps; not compared with warm-up steps)" in warm
    assert "-50%" not in warm and "+100%" not in warm
    assert "(predicted 12.5, +25%)" in warm  # the wall time is compared either way


def test_a_run_that_stopped_early_is_not_held_against_the_forecast_of_its_whole_length() -> None:
    """Stopped by a signal at step 4 of a forecast 2,000: its wall time is of 4 steps, its step time still a step."""
    stopped = _table({**SUMMARY, "interrupted": True, "stop_signal": "SIGTERM"})
    assert "10 (predicted 12.5 for the whole run; it stopped early)" in stopped and "+25%" not in stopped
    assert "1 (predicted 0.5, -50%)" in stopped  # a step is a step however many ran
    budget = _table({**SUMMARY, "interrupted": False, "stop_exit_code": 3})  # a stop the run asked for itself
    assert "it stopped early" in budget and "+25%" not in budget
