"""`gaudi3 tune`: find the fastest configuration that fits, at the global batch the config asks for."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click
from click.core import ParameterSource

from gaudi3_scale.cli.options import Count, Number, Seconds
from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.config.files import check_output_dir
from gaudi3_scale.config.numbers import INT32_MAX, MAX_SECONDS, MAX_WORLD_SIZE, check_number, parse_number

if TYPE_CHECKING:
    from gaudi3_scale.train.config import RunConfig

__all__ = ["tune"]

ONOFF = {"both": (False, True), "on": (True,), "off": (False,)}


def _csv(text: str | None) -> tuple[str, ...] | None:
    """The items of a comma-separated flag; None when it was not given, () when it was given empty (`--precisions
    ,`), which `build_space` refuses rather than reading it as "not given"."""
    return tuple(p.strip() for p in text.split(",") if p.strip()) if text is not None else None


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    items = _csv(text)
    if items is None:
        return None
    try:
        values = tuple(int(parse_number(flag, v, integer=True)) for v in items)
        for v in values:
            check_number(flag, v, low=1, high=INT32_MAX)
    except ConfigError as exc:
        raise UserInputError(f"{flag}: expected comma-separated whole numbers >= 1, got {brief(text)} "
                             f"({exc.problem})") from None  # fmt: skip
    return values


# What a search takes and an estimate does not (`--strategies` and `--precisions` are refused with their own words).
_SEARCH_ONLY = frozenset({
    "time_budget_min", "global_batch", "ckpt", "compile_", "pipeline", "threads", "lr_rule", "warmup_steps",
    "measure_steps", "trial_timeout_s", "out_dir", "no_estimate_pruning", "target_utilization",
})  # fmt: skip
_ESTIMATE_INSTEAD = {
    "--global-batch": " (set --train.global_batch_size)",
    "--target-utilization": " (--memory-budget sets the memory the rows are checked against)",
}


def _check_mode(
    estimate_only: bool, accelerator: str | None, strategies: str | None, precisions: str | None
) -> None:
    """Flags of the other mode are refused, not ignored: a search started by mistake runs for minutes."""
    if accelerator is not None and not estimate_only:
        raise UserInputError(
            "--accelerator: only with --estimate-only (trials run on this machine's devices); add --estimate-only, "
            "or drop --accelerator to tune here"
        )
    given = [
        flag
        for flag, value in (("--strategies", strategies), ("--precisions", precisions))
        if value is not None
    ]
    if estimate_only and given:
        raise UserInputError(
            f"{given[0]}: only shapes the search; --estimate-only lists every strategy at the config's "
            f"train.precision (set that with --train.precision), so drop {given[0]} or --estimate-only"
        )
    if estimate_only:
        ctx = click.get_current_context()
        for param in ctx.command.params:
            if (
                param.name in _SEARCH_ONLY
                and ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE
            ):
                flag = param.opts[0]
                instead = _ESTIMATE_INSTEAD.get(flag, "")
                raise UserInputError(f"{flag}: only shapes the search, which --estimate-only does not run; drop "
                                     f"{flag}{instead} or --estimate-only")  # fmt: skip


def _default_world_size(base: RunConfig, estimate_only: bool) -> int:
    """An estimate models the config's whole world (every node); a search measures on this node: its ranks."""
    return base.parallel.world_size if estimate_only else base.parallel.nproc_per_node


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    epilog="Any config field can be set as --section.field VALUE, as for `gaudi3 train`.",
)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="run config YAML to tune")
@click.option(
    "--world-size",
    type=Count(high=MAX_WORLD_SIZE),
    help="ranks on this node (default: the config's parallel.nproc_per_node); with --estimate-only and "
    "--accelerator: all devices, in whole nodes of the catalog's accelerators per node (8 for gaudi3 and h100)",
)
@click.option(
    "--memory-budget", help="memory per rank a config may use, e.g. 16GiB (default: device × target)"
)
@click.option(
    "--target-utilization",
    type=Number(integer=False, low=0.05, high=1.0, expected="must be a fraction from 0.05 to 1"),
    default=0.95,
    show_default=True,
    help="fraction of device memory a config may use when --memory-budget is not given",
)
@click.option(
    "--time-budget-min",
    type=Number(integer=False, above=0, high=MAX_SECONDS / 60),
    help="start no trial after this many minutes",
)
@click.option(
    "--global-batch",
    help="global batch(es) in sequences to consider, comma-separated (default: the config's)",
)
@click.option("--strategies", help="comma-separated subset (default: every one available)")
@click.option("--precisions", help="comma-separated subset (default: every one the hardware supports)")
@click.option(
    "--activation-checkpointing",
    "ckpt",
    type=click.Choice(list(ONOFF)),
    default="both",
    show_default=True,
    help="search activation checkpointing on, off or both",
)
@click.option(
    "--compile",
    "compile_",
    type=click.Choice(list(ONOFF)),
    default="both",
    show_default=True,
    help="search torch.compile on, off or both",
)
@click.option(
    "--pipeline",
    type=click.Choice(list(ONOFF)),
    default="both",
    show_default=True,
    help="search pipeline-parallel layouts (1F1B, for fsdp and fsdp_grad_op) on, off or both",
)
@click.option(
    "--threads", help="CPU threads per rank to try, comma-separated (default: cores÷ranks and half)"
)
@click.option(
    "--lr-rule",
    type=click.Choice(["sqrt", "linear", "none"]),
    default="sqrt",
    show_default=True,
    help="learning-rate rescaling when the global batch changes",
)
@click.option(
    "--warmup-steps", type=Count(low=0), default=2, show_default=True, help="unmeasured steps per trial"
)
@click.option("--measure-steps", type=Count(), default=5, show_default=True, help="measured steps per trial")
@click.option(
    "--trial-timeout-s", type=Seconds(), default=300.0, show_default=True, help="kill a trial after this"
)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="results (default runs/<name>-tune)")
@click.option(
    "--no-estimate-pruning",
    is_flag=True,
    help="run configurations the memory estimate says cannot fit (only trials decide; e.g. a custom model)",
)
@click.option("--estimate-only", is_flag=True, help="print the memory estimate table and exit; runs nothing")
@click.option(
    "--accelerator",
    help="with --estimate-only: list every layout the trainer supports on --world-size of these devices "
    "(strategy, tensor parallel, HSDP, activation checkpointing, offload where needed), whether it fits and why "
    "not (e.g. gaudi3, h100); with --memory-budget: the strategy table checked against that budget",
)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def tune(
    config_path: str | None,
    world_size: int | None,
    memory_budget: str | None,
    target_utilization: float,
    time_budget_min: float | None,
    global_batch: str | None,
    strategies: str | None,
    precisions: str | None,
    ckpt: str,
    compile_: str,
    pipeline: str,
    threads: str | None,
    lr_rule: str,
    warmup_steps: int,
    measure_steps: int,
    trial_timeout_s: float,
    out_dir: str | None,
    no_estimate_pruning: bool,
    estimate_only: bool,
    accelerator: str | None,
    overrides: tuple[str, ...],
) -> None:
    """Tune micro-batch × accumulation × strategy (with tensor and pipeline parallel) × precision × activation
    checkpointing × compile × threads.

    Every trial is a short real `gaudi3 train` run in its own process group; the winner is written as a YAML
    that `gaudi3 train --config` takes. Exit 0 with a winner, 1 when nothing fits, 2 on bad input.
    """
    from gaudi3_scale.cli.config_cmd import wide_console
    from gaudi3_scale.cli.doctor_cmd import doctor_once_for_trainings
    from gaudi3_scale.train.config import resolve_config
    from gaudi3_scale.tune.config import TuneConfig, parse_bytes

    _check_mode(estimate_only, accelerator, strategies, precisions)
    base = resolve_config(config_path, overrides)
    doctor_once_for_trainings(config_path, overrides)  # in the training image only
    # Trials run on this node: a multi-node config is tuned at one node's ranks (the winner is that node's layout).
    world = world_size if world_size is not None else _default_world_size(base, estimate_only)
    budget = parse_bytes(memory_budget) if memory_budget else None
    global_batches, thread_counts = (
        _ints(global_batch, "--global-batch"),
        _ints(threads, "--threads"),
    )  # all checked
    console = wide_console()
    if estimate_only:
        from gaudi3_scale.tune.estimate_table import print_estimate_table

        print_estimate_table(
            base, world_size=world, memory_budget_bytes=budget, accelerator=accelerator, console=console
        )
        return
    from gaudi3_scale.device.select import check_device_precision

    # as `gaudi3 train` does before it starts ranks: a device this machine lacks is one line, not a table of crashes
    # (the device only: each trial runs a precision of the search space, `--precisions`, not the base config's)
    check_device_precision(base.train.device, "auto")
    from gaudi3_scale.tune.space import build_space
    from gaudi3_scale.tune.tuner import (
        check_memory_budget,
        check_winner_configs,
        default_memory_budget,
        open_trial_cache,
        print_report,
        run_tuner,
    )

    space = build_space(
        base,
        world_size=world,
        global_batches=global_batches,
        strategies=_csv(strategies),
        precisions=_csv(precisions),
        activation_checkpointing=ONOFF[ckpt],
        compile=ONOFF[compile_],
        threads=thread_counts,
        pipeline=ONOFF[pipeline],
    )
    config = TuneConfig(
        world_size=world,
        memory_budget_bytes=budget,
        target_utilization=target_utilization,
        time_budget_s=time_budget_min * 60 if time_budget_min is not None else None,
        lr_rule=lr_rule,  # type: ignore[arg-type]
        warmup_steps=warmup_steps,
        measure_steps=measure_steps,
        trial_timeout_s=trial_timeout_s,
        prune_by_estimate=not no_estimate_pruning,
    )
    if config.memory_budget_bytes is None:
        from dataclasses import replace

        config = replace(
            config, memory_budget_bytes=default_memory_budget(space.device, world, target_utilization)
        )
    out = Path(out_dir) if out_dir else Path("runs") / f"{base.name}-tune"
    check_output_dir("--out", out)
    cache = open_trial_cache(base, space, config, out)  # a damaged trials.jsonl: one line before any output
    estimate = check_memory_budget(base, space, config)  # and a budget no configuration fits
    refusal = check_winner_configs(base, space, lr_rule)  # and a winner that could not be written
    console.print(f"tuning {space.describe()}", highlight=False)
    assert config.memory_budget_bytes is not None
    console.print(f"memory budget per rank: {config.memory_budget_bytes / 2**30:.2f} GiB", highlight=False)
    from gaudi3_scale.forecast.feed import feed_tune_trial  # each trial run now is a probe for the store

    result = run_tuner(
        base,
        space,
        config,
        out,
        console=console,
        estimate=estimate,
        on_trial=feed_tune_trial,
        cache=cache,
        refusal=refusal,
    )
    print_report(result, console)
    if result.best is None:
        raise SystemExit(1)
