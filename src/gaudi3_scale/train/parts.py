"""The parts of a run that act after each step, built from its config for one fit: the metrics
(`train.step_metrics`), the checkpoint and the graceful stop (`train.callbacks`), live cost, the profiler, the
progress bar, the health report (`train.step_health`) and the hang watchdog, gathered in one
`train.after_step.AfterStep`; and what the run's checkpoints hold beyond Lightning's entries, registered by its
owners (`checkpoint.contents`).

This is part of the trainer's assembly: it sees the whole run config, which every checkpoint holds. The services
that run beside the fit start from these parts (`train.services`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from gaudi3_scale.checkpoint.checkpointer import Checkpointer
from gaudi3_scale.checkpoint.contents import CONFIG_KEY, HEALTH_KEY, RNG_KEY, CheckpointContents, FixedState
from gaudi3_scale.config.core import config_sha256, to_dict
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.data.tokenizers import Tokenizer, tokenizer_sha256
from gaudi3_scale.device import DevicePlan
from gaudi3_scale.distributed.env import launched_local_rank, launched_local_world_size
from gaudi3_scale.distributed.plan import ParallelPlan
from gaudi3_scale.distributed.strategies import saves_sharded
from gaudi3_scale.health.config import HealthConfig
from gaudi3_scale.health.guard import StepGuard
from gaudi3_scale.health.heartbeat import HEALTH_DIR
from gaudi3_scale.health.stragglers import StragglerDetector
from gaudi3_scale.train.after_step import AfterStep
from gaudi3_scale.train.callbacks import GracefulInterrupt, StepCheckpoint
from gaudi3_scale.train.config import RunConfig
from gaudi3_scale.train.cost_callback import LiveCost, build_live_cost
from gaudi3_scale.train.progress import RichStepProgress
from gaudi3_scale.train.rng import RngStates
from gaudi3_scale.train.step import StepState
from gaudi3_scale.train.step_health import StepHealth
from gaudi3_scale.train.step_metrics import RunMetrics
from gaudi3_scale.train.train_config import TrainConfig

if TYPE_CHECKING:
    from gaudi3_scale.health.watchdog import Watchdog
    from gaudi3_scale.train.profile_callback import StepProfiler

__all__ = ["build_after_step", "build_watchdog"]


def build_after_step(
    cfg: RunConfig,
    state: StepState,
    *,
    strategy: Any,
    parallel: ParallelPlan,
    device: DevicePlan,
    guard: StepGuard | None,
    data_sha256: str | None,
    our_model: bool,
    rank: int,
    console: Console,
    progress: bool,
    warn: Callable[[str], None],
    note: Callable[[str], None],
    tokenizer: Tokenizer | None = None,
) -> tuple[AfterStep, StepHealth | None]:
    """The parts for a module whose steps write `state`, and the health report of the step guard of our own model
    (`guard`; None: off). `our_model`: the registry model (its checkpoints record the strategy by name), trained
    on data of SHA-256 `data_sha256` made by `tokenizer` (None for a module of the user's: nothing to record)."""
    train, out = cfg.train, cfg.output_dir
    metrics = _run_metrics(train, cfg.health, state, out, data_parallel_size=parallel.data_parallel_size,
                           peak_flops=device.peak_flops, warn=warn)  # fmt: skip
    checkpoint = _step_checkpoint(cfg, state, strategy, parallel.strategy, metrics, data_sha256=data_sha256,
                                  tokenizer=tokenizer, our_model=our_model, rank=rank, warn=warn)  # fmt: skip
    stop = GracefulInterrupt(checkpoint, console)
    cost = build_live_cost(cfg.cost, metrics, stop, checkpoint, nodes=cfg.parallel.nnodes, max_steps=train.max_steps,
                           warn=warn, note=note, announce=progress)  # fmt: skip
    _register_contents(checkpoint.checkpointer.contents, cfg, checkpoint, cost, guard)
    health = StepHealth(guard, metrics, warn=warn) if guard is not None else None
    watchdog = checkpoint.watchdog = build_watchdog(cfg.health, out, rank=rank,
                                                    warmup_steps=train.resolved_throughput_warmup_steps())  # fmt: skip
    after = AfterStep(metrics=metrics, stop=stop, checkpoint=checkpoint, cost=cost, health=health,
                      profiler=_profiler(train, out, device.accelerator, metrics, warn=warn, note=note),
                      progress=RichStepProgress(metrics, console=console) if progress else None, state=state,
                      watchdog=watchdog)  # fmt: skip
    return after, health


def _run_metrics(
    train: TrainConfig,
    health: HealthConfig,
    state: StepState,
    out_dir: Path,
    *,
    data_parallel_size: int,
    peak_flops: float | None,
    warn: Callable[[str], None],
) -> RunMetrics:
    """metrics.jsonl and its listeners, with the straggler detector it feeds (`health.stragglers`)."""
    stragglers = None
    if health.stragglers:
        stragglers = StragglerDetector(threshold=health.straggler_threshold, windows=health.straggler_windows,
                                       warn=warn)  # fmt: skip
    return RunMetrics(out_dir / "metrics.jsonl", log_every_steps=train.log_every_steps, state=state,
                      peak_flops_per_device=peak_flops, data_parallel_size=data_parallel_size,
                      warmup_steps=train.resolved_throughput_warmup_steps(), stragglers=stragglers,
                      warn=warn)  # fmt: skip


def _step_checkpoint(
    cfg: RunConfig,
    state: StepState,
    strategy: Any,
    strategy_name: str,
    metrics: RunMetrics,
    *,
    data_sha256: str | None,
    tokenizer: Tokenizer | None,
    our_model: bool,
    rank: int,
    warn: Callable[[str], None],
) -> StepCheckpoint:
    """When the run saves, through a started `Checkpointer`: rank 0 uploads committed checkpoints to
    checkpoint.remote_url; local copies stay until verified. The registry model's checkpoints name the resolved
    strategy (`strategy_name`), a module of the user's the Lightning strategy's class."""
    ckpt = cfg.checkpoint
    if ckpt.enabled and ckpt.light_every_steps and saves_sharded(strategy):
        raise ConfigError(
            "checkpoint.light_every_steps",
            f"light checkpoints are one file written by rank 0, but parallel.strategy {strategy_name} "
            "saves sharded checkpoints (not supported yet); set it to 0 and export a full checkpoint instead",
        )
    checkpointer = Checkpointer(ckpt, cfg.output_dir / "checkpoints", rank=rank, warn=warn).start()
    if (mirror := checkpointer.mirror) is not None:
        metrics.sources.append(lambda: mirror.status().as_metrics())
    return StepCheckpoint(
        checkpointer, every_steps=ckpt.every_steps, val_every_steps=cfg.train.val_every_steps, metrics=metrics,
        warn=warn, config_sha256=config_sha256(cfg), enabled=ckpt.enabled, data_sha256=data_sha256,
        tokenizer_sha256=tokenizer_sha256(tokenizer) if tokenizer is not None else None,
        tokens_per_step=state.tokens_per_step, strategy=strategy_name if our_model else None,
        light_every_steps=ckpt.light_every_steps,
    )  # fmt: skip


def _register_contents(
    contents: CheckpointContents,
    cfg: RunConfig,
    checkpoint: StepCheckpoint,
    cost: LiveCost | None,
    guard: StepGuard | None,
) -> None:
    """What our checkpoints hold beyond Lightning's entries, by owner (checkpoint.contents)."""
    contents.register(CONFIG_KEY, FixedState(to_dict(cfg)), light=True)
    contents.register(RNG_KEY, RngStates())
    contents.register("step_checkpoint", checkpoint, light=True, meta=True)
    if cost is not None:
        contents.register("cost", cost, light=True, meta=True)
    if guard is not None:
        contents.register(HEALTH_KEY, guard)


def _profiler(
    train: TrainConfig,
    out_dir: Path,
    accelerator: str,
    metrics: RunMetrics,
    *,
    warn: Callable[[str], None],
    note: Callable[[str], None],
) -> StepProfiler | None:
    """The profiler's window (`train.profile_start_step`; None: not profiled)."""
    if train.profile_start_step is None:
        return None
    from gaudi3_scale.train.profile_callback import StepProfiler

    return StepProfiler(out_dir, start_step=train.profile_start_step, num_steps=train.profile_num_steps,
                        accelerator=accelerator, metrics=metrics, note=note, warn=warn)  # fmt: skip


def build_watchdog(health: HealthConfig, out_dir: Path, *, rank: int, warmup_steps: int) -> Watchdog | None:
    """This rank's hang watchdog (`health.watchdog`): AfterStep and the checkpoint enter its sections; it starts
    with the services beside the fit (`train.services`)."""
    if not health.watchdog:
        return None
    from gaudi3_scale.health.watchdog import Watchdog

    return Watchdog(
        health, out_dir / HEALTH_DIR, rank=rank, local_rank=launched_local_rank(),
        local_world_size=launched_local_world_size(), warmup_steps=warmup_steps,
    )  # fmt: skip
