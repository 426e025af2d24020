"""Python entry point of the tuner: `AdaptiveBatchFinder(model=…).find_optimal_batch_size()`."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from gaudi3_scale.config.core import to_dict
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.config.numbers import check_range
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.registry import list_models
from gaudi3_scale.train.config import RunConfig, build_run_config
from gaudi3_scale.tune.config import TuneConfig
from gaudi3_scale.tune.space import build_space, device_kind, supported_precisions
from gaudi3_scale.tune.trial import TrialResult
from gaudi3_scale.tune.tuner import TuneResult, default_memory_budget, run_tuner

__all__ = ["AdaptiveBatchFinder"]


class AdaptiveBatchFinder:
    """Find the fastest micro-batch (with the accumulation that keeps the global batch) and the rest of the
    configuration, by short real training trials.

    `model`: a registry name (e.g. ``"gpt2-124m"``), a `ModelConfig`, or a whole `RunConfig`.
    `target_hpu_utilization`: the fraction of each device's memory the chosen configuration may use (the name is
    the seed's; it applies to CPU RAM and CUDA memory too). `precision`: the one precision to search, refused when
    the hardware does not support it; None (the default) = every precision it supports. `on_trial(result,
    run_dir)`: called with each trial run now (not one from the cache); the line it returns is printed under the
    trial's. `gaudi3 tune` passes
    `gaudi3_scale.forecast.feed.feed_tune_trial`, which stores each trial in this machine's calibration store for
    `gaudi3 plan`; None (the default) feeds nothing. `activation_checkpointing`, `compile`, `pipeline` and
    `threads` take a tuple of the values to try, or one value. `memory_budget_bytes`: per rank; None = the device's
    memory × `target_hpu_utilization`. Other keyword arguments are `gaudi3 tune`'s options.
    """

    def __init__(
        self,
        model: str | ModelConfig | RunConfig = "shakespeare-char",
        *,
        target_hpu_utilization: float = 0.95,
        precision: str | None = None,
        world_size: int = 1,
        global_batch_size: int | None = None,
        overrides: Sequence[tuple[str, str]] = (),
        strategies: str | tuple[str, ...] | None = None,
        activation_checkpointing: bool | tuple[bool, ...] = (False, True),
        compile: bool | tuple[bool, ...] = (False, True),
        threads: int | tuple[int | None, ...] | None = None,
        pipeline: bool | tuple[bool, ...] = (False, True),
        time_budget_s: float | None = None,
        memory_budget_bytes: int | None = None,
        measure_steps: int = 5,
        out_dir: str | Path | None = None,
        console: Console | None = None,
        on_trial: Callable[[TrialResult, Path], str | None] | None = None,
    ) -> None:
        # Checked before anything uses them: the default budget is RAM × utilization, and "0.9" × RAM in bytes is
        # a string of that many characters.
        check_range("target_hpu_utilization", target_hpu_utilization, 0.05, 1.0)
        config = TuneConfig(
            world_size=world_size,
            memory_budget_bytes=memory_budget_bytes,  # None = the default below; 0 is refused, not replaced
            target_utilization=target_hpu_utilization,
            time_budget_s=time_budget_s,
            measure_steps=measure_steps,
        )
        self.base = _run_config(model, overrides, global_batch_size)
        _check_precision(precision, self.base)
        self.space = build_space(
            self.base,
            world_size=world_size,
            strategies=strategies,
            precisions=(precision,) if precision else None,
            activation_checkpointing=activation_checkpointing,
            compile=compile,
            threads=threads,
            pipeline=pipeline,
        )
        if config.memory_budget_bytes is None:
            budget = default_memory_budget(self.space.device, world_size, target_hpu_utilization)
            config = replace(config, memory_budget_bytes=budget)
        self.config = config
        self.out_dir = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="gaudi3-tune-"))
        self.console = console
        self.on_trial = on_trial
        self.result: TuneResult | None = None

    def run(self) -> TuneResult:
        self.result = run_tuner(
            self.base, self.space, self.config, self.out_dir, console=self.console, on_trial=self.on_trial
        )
        return self.result

    def find_optimal_batch_size(self) -> int:
        """The winning micro-batch size per rank (`self.result` holds everything else, `best_config` the YAML's
        config). Raises RuntimeError when no configuration fits."""
        result = self.run()
        if result.best is None:
            raise RuntimeError(f"no configuration fits: {result.outcome.limit}")
        return result.best.candidate.micro_batch_size


def _check_precision(precision: str | None, base: RunConfig) -> None:
    """One line naming this API's argument: `build_space` would name `gaudi3 tune`'s --precisions flag."""
    if precision is None:
        return
    device = device_kind(base)
    supported = supported_precisions(device)
    if precision not in supported:
        raise UserInputError(
            f"precision={precision!r} is not supported on {device} here; allowed: "
            f"{', '.join(map(repr, supported))}, or None for every one of them"
        )


def _run_config(
    model: str | ModelConfig | RunConfig, overrides: Sequence[tuple[str, str]], global_batch_size: int | None
) -> RunConfig:
    pairs = list(overrides)
    if global_batch_size is not None:
        pairs.append(("train.global_batch_size", str(global_batch_size)))
    if isinstance(model, RunConfig):
        return build_run_config(None, pairs, base=to_dict(model)) if pairs else model
    if isinstance(model, ModelConfig):
        return build_run_config(None, pairs, base={"model": to_dict(model)})
    if not isinstance(model, str):  # e.g. an nn.Module: trials train in fresh processes, from a config
        raise ConfigError(
            "model",
            f"AdaptiveBatchFinder takes a registry name ({', '.join(list_models())}), a ModelConfig or a "
            f"RunConfig, not a {type(model).__name__}; trials train the model in fresh processes, from its config",
        )
    return build_run_config(None, [("model.name", model), *pairs])
