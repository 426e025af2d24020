"""What summary.json says about a finished fit, read from the run's parts (`train.after_step.AfterStep`) once it
has ended: losses, throughput and MFU over the measured steps, why and where it stopped, its checkpoint, device,
cost and health. `train.report` writes it, draws loss.png and prints the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gaudi3_scale.monitor.perf import mfu, mfu_above_peak

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from gaudi3_scale.device import DevicePlan
    from gaudi3_scale.health.stragglers import StragglerDetector
    from gaudi3_scale.models import ModelConfig
    from gaudi3_scale.train.after_step import AfterStep
    from gaudi3_scale.train.step_health import StepHealth
    from gaudi3_scale.train.step_metrics import RunMetrics

__all__ = ["health_summary", "plot_title", "run_summary"]


def run_summary(
    after: AfterStep,
    trainer: pl.Trainer,
    *,
    records: list[dict[str, Any]],
    wall_s: float,
    run_name: str,
    model: ModelConfig,
    device_plan: DevicePlan | None,
    health: StepHealth | None,
    warn: Callable[[str], None],
) -> dict[str, Any]:
    """The fit's summary (keys in summary.json's order) from its metrics records and its parts."""
    train = [r for r in records if r.get("train_loss") is not None]
    val = [r for r in records if r.get("val_loss") is not None]
    plan, live = device_plan, after.cost
    # Masked-language modelling also scores its predictions (train.module): a key of BERT runs' summaries only.
    accuracy = {"val_mlm_accuracy": val[-1].get("val_mlm_accuracy") if val else None}
    return {
        "name": run_name,
        "model": model.name,
        "steps": trainer.global_step,
        "train_loss": train[-1]["train_loss"] if train else None,
        "val_loss": val[-1]["val_loss"] if val else None,
        **(accuracy if model.arch == "bert" else {}),
        **_throughput(after.metrics, train, plan, world_size=trainer.world_size, warn=warn),
        "peak_memory_bytes": max((r.get("peak_memory_bytes") or 0 for r in train), default=None),
        "wall_s": wall_s,
        **_stop(after, trainer),
        "device": plan.device_name if plan else None,
        "precision": plan.precision_name if plan else None,
        "cost_usd": live.meter.cost_usd if live is not None else None,
        "cost_budget_usd": live.meter.budget_usd if live is not None else None,
        "health": health_summary(health, after.metrics.stragglers),
    }


def _throughput(
    metrics: RunMetrics,
    train: list[dict[str, Any]],
    plan: DevicePlan | None,
    *,
    world_size: int,
    warn: Callable[[str], None],
) -> dict[str, Any]:
    """tokens/s, MFU and step time over the measured steps, after this process's warm-up steps
    (train.throughput_warmup_steps), whose time (compilation included) is reported on its own."""
    steady = metrics.steady_state()
    tokens_per_s, step_time_s = steady["tokens_per_s"], steady["step_time_s"]
    if tokens_per_s is None and train:  # a resumed, already finished run: what its last window measured
        tokens_per_s, step_time_s = train[-1].get("tokens_per_s"), train[-1].get("step_time_s")
    fpt = metrics.state.flops_per_token
    value = mfu(tokens_per_s, fpt, plan.peak_flops, world_size) if tokens_per_s and fpt and plan else None
    # On CPU the peak is the matmul ceiling measured at start, not a datasheet figure.
    above = mfu_above_peak(value, peak_measured=plan is None or plan.accelerator == "cpu")
    if above:
        warn(above)
    return {
        "tokens_per_s": tokens_per_s,
        "mfu": value,
        "mfu_peak_source": plan.peak_source if plan else None,
        "mfu_above_peak": above is not None,
        "step_time_s": step_time_s,
        "measured_steps": steady["measured_steps"],
        "warmup_steps": steady["warmup_steps"],
        "warmup_s": steady["warmup_s"],
        "throughput_includes_warmup": steady["includes_warmup"],
        "profiled_steps": steady["profiled_steps"],  # run under the profiler: not in the figures above
    }


def _stop(after: AfterStep, trainer: pl.Trainer) -> dict[str, Any]:
    """Whether and why the fit stopped early, what the saves cost it, and the checkpoint it leaves."""
    interrupt, checkpoint = after.stop, after.checkpoint
    committed = checkpoint.manager.committed()
    last = checkpoint.last_path or (committed[-1][1] if committed else None)
    return {
        "interrupted": bool(trainer.interrupted or checkpoint.save_requested),
        # A stop the run asked for itself (budget, spot price) has an exit code of its own and no signal.
        "stop_signal": interrupt.signal_name if interrupt.exit_code is None else None,
        "stop_reason": interrupt.reason if interrupt.signal_name else None,
        "stop_exit_code": interrupt.exit_code,
        "signal_to_checkpoint_s": interrupt.signal_to_checkpoint_s,
        # checkpoint_blocking_s (the newest 64 saves), _count, _total_s, _max_s
        **checkpoint.blocking_s.summary("checkpoint_blocking"),
        "checkpoint": str(last) if last else None,
    }


def health_summary(health: StepHealth | None, stragglers: StragglerDetector | None) -> dict[str, Any] | None:
    """summary.json's `health`: the guard's counts and events, and the stragglers named (None: all off)."""
    summary = health.summary() if health is not None else None
    if stragglers is not None:
        summary = {**(summary or {}), "stragglers": [s.record() for s in stragglers.episodes]}
    return summary


def plot_title(run_name: str, model_name: str) -> str:
    """loss.png's title: the run's name, and its model's when they differ."""
    return run_name if run_name == model_name else f"{run_name} ({model_name})"
