"""`gaudi3 tune` end to end: space → search with real trials → ranked table, CSV, JSON and the winner's YAML."""

from __future__ import annotations

import csv
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from gaudi3_scale.config import strict_json
from gaudi3_scale.config.core import config_sha256, from_dict, save_yaml, to_dict
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.distributed.plan import ParallelPlan
from gaudi3_scale.train.config import RunConfig, config_dict
from gaudi3_scale.train.train_config import fp8_option_defaults
from gaudi3_scale.tune.config import TuneConfig
from gaudi3_scale.tune.layouts import PP_SCHEDULE
from gaudi3_scale.tune.lr import LR_RULES, rescale_schedule, rescale_step_fields
from gaudi3_scale.tune.search import RefusalFn, SearchOutcome, TrialCache, search
from gaudi3_scale.tune.space import Candidate, SearchSpace, offload_options
from gaudi3_scale.tune.trial import TrialResult, TrialSettings, run_trial

__all__ = [
    "TuneResult",
    "check_memory_budget",
    "check_winner_configs",
    "default_memory_budget",
    "open_trial_cache",
    "run_tuner",
    "winner_config",
]


@dataclass
class TuneResult:
    outcome: SearchOutcome
    space: SearchSpace
    config: TuneConfig
    base: RunConfig
    best_config: RunConfig | None
    out_dir: Path
    lr_note: str

    @property
    def best(self) -> TrialResult | None:
        return self.outcome.best


def default_memory_budget(device: str, world_size: int, target_utilization: float) -> int:
    """Per-rank budget: the device's memory (CPU: this host's RAM shared by the ranks) × target utilization."""
    if device == "cuda":
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
    elif device == "hpu":
        # this node's Gaudi (2 and 3 differ: 96 vs 128 GB); not yet validated on Gaudi hardware
        from gaudi3_scale.device.select import detected_hpu_name
        from gaudi3_scale.device.specs import find_accelerator

        name = detected_hpu_name()
        spec = find_accelerator(name) if name else None
        if spec is None or not spec.memory_gb:
            seen = (
                f"this node's Gaudi {name!r} has no catalogued memory" if name else "no Gaudi is visible here"
            )
            raise UserInputError(
                f"--memory-budget: {seen} to size it from; give it, e.g. --memory-budget 80GiB"
            )
        total = int(spec.memory_gb * 1e9)
    else:
        import psutil

        total = psutil.virtual_memory().total // world_size
    return int(total * target_utilization)


def _estimator(base: RunConfig, space: SearchSpace) -> Callable[[Candidate], int | None]:
    from gaudi3_scale.tune.estimate_table import resolved_model
    from gaudi3_scale.tune.memory import estimate_memory, process_peak_bytes

    model = resolved_model(base.model, base.data)

    def estimate(c: Candidate) -> int | None:
        plan = ParallelPlan.build(
            strategy=c.strategy,
            world_size=space.world_size,
            tp_size=c.tp_size,
            dp_replicate=c.dp_replicate,
            offload=c.offload,
            activation_checkpointing=c.activation_checkpointing,
            compile=c.compile,
            float8=base.float8_plan() if c.precision == "fp8" else None,
            pp_size=c.pp_size,
            pp_schedule=PP_SCHEDULE,
            pp_split=c.pp_split,
        )
        batch = c.batch_plan(space.world_size, base.model.context_length)
        est = estimate_memory(model, plan, batch, precision=c.precision, device_kind=space.device)
        return process_peak_bytes(est)  # as a trial measures it and `gaudi3 plan` forecasts it

    return estimate


def check_memory_budget(
    base: RunConfig,
    space: SearchSpace,
    config: TuneConfig,
    estimate: Callable[[Candidate], int | None] | None = None,
) -> Callable[[Candidate], int | None]:
    """The search's memory estimate (`estimate`, or the model's); one line (exit 2) when the budget holds none of
    `space`'s configurations and the search prunes by the estimate."""
    estimate = estimate or _estimator(base, space)
    if config.prune_by_estimate and config.memory_budget_bytes is not None:
        _check_budget_possible(space, estimate, config.memory_budget_bytes)
    return estimate


def _check_budget_possible(
    space: SearchSpace, estimate: Callable[[Candidate], int | None], budget: int
) -> None:
    """An impossible memory budget is bad input (exit 2), not a search that prunes everything."""
    # offload counts too: the search tries it for groups that fit nowhere without it
    points = [
        v
        for c in space.candidates()
        for v in (c, *(replace(c, offload=o) for o in offload_options(c.strategy)))
    ]
    sized = [(e, c) for c in points if (e := estimate(c)) is not None]
    if not sized:
        return
    smallest, c = min(sized, key=lambda ec: ec[0])
    if smallest > budget:
        raise UserInputError(
            f"--memory-budget {budget / 2**30:.2f} GiB per rank cannot hold any configuration: the smallest "
            f"estimate is {smallest / 2**30:.2f} GiB ({c.label(space.world_size)}); give at least that, more "
            "ranks, or --no-estimate-pruning to let trials decide"
        )


def winner_config(base: RunConfig, c: Candidate, world_size: int, rule: str) -> tuple[RunConfig, str]:
    """The run config of candidate `c` on one node of `world_size` ranks (the layout its trial measured), every
    step count rescaled to keep its tokens at `c`'s global batch; validated like any config. The base's other values
    are kept."""
    raw = to_dict(base)
    sched = rescale_schedule(
        lr=base.optim.lr,
        min_lr=base.optim.min_lr,
        warmup_steps=base.optim.warmup_steps,
        max_steps=base.train.max_steps,
        from_batch=base.train.global_batch_size,
        to_batch=c.global_batch_size,
        rule=rule,  # type: ignore[arg-type]
    )
    raw["optim"].update(lr=sched.lr, min_lr=sched.min_lr, warmup_steps=sched.warmup_steps)
    raw["train"].update(
        global_batch_size=c.global_batch_size,
        global_batch_tokens=None,
        micro_batch_size=c.micro_batch_size,
        precision=c.precision,
        compile=c.compile,
        # the mode its trial ran (Candidate.overrides): its own, else the config's when it compiles
        compile_mode=c.compile_mode
        if c.compile_mode != "default" or not c.compile
        else base.train.compile_mode,
        threads=c.threads,
        # A length in epochs reads the same tokens at any batch; only a length in steps is rescaled.
        max_steps=base.train.max_steps if base.train.max_epochs is not None else sched.max_steps,
    )
    if c.precision != "fp8":
        raw["train"].update(fp8_option_defaults())  # as its trials ran (Candidate.overrides)
    changed = rescale_step_fields(raw, sched.factor)
    raw["parallel"].update(nproc_per_node=world_size, nnodes=1, node_rank=0, **c.layout().parallel_fields())
    if base.parallel.nnodes > 1:
        raw["parallel"]["rdzv_endpoint"] = None  # node 0's of the nodes it had; one node opens its own
    note = sched.describe(rule, max_epochs=base.train.max_epochs)
    if changed:
        note += f"; {', '.join(changed)} keep their token counts too"
    return from_dict(RunConfig, raw), note


def check_winner_configs(base: RunConfig, space: SearchSpace, rule: str) -> RefusalFn:
    """Why a candidate's best.yaml would be refused (None: it would not), for the search to prune it; one line
    (exit 2) now, before any trial, when every candidate of a global batch is refused: a search must not spend its
    time on a winner that cannot be written."""
    reasons: dict[str, str | None] = {}

    def refusal(c: Candidate) -> str | None:
        if c.key not in reasons:
            try:
                winner_config(base, c, space.world_size, rule)
                reasons[c.key] = None
            except ConfigError as exc:
                reasons[c.key] = str(exc)
        return reasons[c.key]

    candidates = space.candidates()
    for gb in space.global_batches:
        of_gb = [c for c in candidates if c.global_batch_size == gb]
        if of_gb and all(refusal(c) is not None for c in of_gb):  # stops at the first that would be written
            k = gb / base.train.global_batch_size
            rescaled = f" (step counts ×{1 / k:.3g} to keep their tokens)" if k != 1 else ""
            raise UserInputError(
                f"global batch {gb}: the winner's config would be refused{rescaled}: {refusal(of_gb[0])}; change "
                "that field, or tune other global batches"
            )
    return refusal


def _fingerprint(base: RunConfig, space: SearchSpace, config: TuneConfig) -> str:
    """Trials are reused only for the same run config, ranks, budget and measurement settings."""
    return config_sha256(
        {
            "run": to_dict(base),
            "world_size": space.world_size,
            "memory_budget_bytes": config.memory_budget_bytes,
            "warmup_steps": config.warmup_steps,
            "measure_steps": config.measure_steps,
            "trial_timeout_s": config.trial_timeout_s,
        }
    )


def open_trial_cache(base: RunConfig, space: SearchSpace, config: TuneConfig, out_dir: Path) -> TrialCache:
    """The trials `out_dir` already holds for this config and settings; a damaged trials.jsonl is one line (exit 2)
    here, before anything in `out_dir` is written."""
    return TrialCache(out_dir / "trials.jsonl", _fingerprint(base, space, config))


def run_tuner(
    base: RunConfig,
    space: SearchSpace,
    config: TuneConfig,
    out_dir: Path,
    *,
    console: Console | None = None,
    estimate: Callable[[Candidate], int | None] | None = None,
    extra_overrides: tuple[str, ...] = (),
    on_trial: Callable[[TrialResult, Path], str | None] | None = None,
    cache: TrialCache | None = None,
    refusal: RefusalFn | None = None,
) -> TuneResult:
    """Search `space` with real trials under `out_dir`; `on_trial(result, run_dir)` sees each trial run now (not
    one from the cache) with its run directory, and the line it returns is printed under the trial's
    (`gaudi3 tune` feeds the calibration store with it: forecast.feed). `cache`: `open_trial_cache`'s (default:
    opened here); `refusal`: `check_winner_configs`'s (default: checked here)."""
    console = console or Console(stderr=True)
    if cache is None:
        cache = open_trial_cache(base, space, config, out_dir)
    estimate = check_memory_budget(base, space, config, estimate)  # refused: nothing written
    if refusal is None:
        refusal = check_winner_configs(base, space, config.lr_rule)  # refused: nothing written
    out_dir.mkdir(parents=True, exist_ok=True)
    trials_dir = out_dir / "trials"
    base_yaml = out_dir / "base.yaml"
    save_yaml(config_dict(base), base_yaml)
    settings = TrialSettings(
        world_size=space.world_size,
        device=space.device,
        warmup_steps=config.warmup_steps,
        measure_steps=config.measure_steps,
        timeout_s=config.trial_timeout_s,
        memory_budget_bytes=config.memory_budget_bytes,
        spike_policy=base.health.spike_policy,
        extra_overrides=extra_overrides,
    )
    context = base.model.context_length

    def run(c: Candidate, est: int | None) -> TrialResult:
        progress.update(task, description=f"trial: {c.label(space.world_size)}")
        return run_trial(
            base_yaml,
            c,
            settings,
            trials_dir / c.key,
            tokens_per_step=c.batch_plan(space.world_size, context).tokens_per_step,
            estimate_bytes=est,
        )

    def on_result(r: TrialResult, cached: bool) -> None:
        if r.ran:
            progress.advance(task)
            tps = f"{r.tokens_per_s:,.0f} tok/s" if r.tokens_per_s else r.status
            progress.console.print(
                f"  {r.candidate.label(space.world_size)}: {tps}{' (cached)' if cached else ''}"
                + ("" if r.status == "ok" else f" — {r.reason}"),
                highlight=False,
            )
        if r.ran and not cached and on_trial is not None:
            note = on_trial(r, trials_dir / r.candidate.key / "run")
            if note:
                progress.console.print(f"    {note}", highlight=False)

    groups = len(space.strategies) * len(space.precisions) * len(space.global_batches)
    expected = groups * 3 + len(space.threads) + 1  # rough: the bar's total grows if the search needs more
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} trials"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("tuning", total=expected)

        def on_result_growing(r: TrialResult, cached: bool) -> None:
            total = progress.tasks[0].total or 0
            if r.ran and progress.tasks[0].completed + 1 >= total:
                progress.update(task, total=total + 2)
            on_result(r, cached)

        outcome = search(
            space,
            config,
            run=run,
            estimate=estimate,
            cache=cache,
            on_result=on_result_growing,
            refusal=refusal,
        )
    if base.parallel.nnodes > 1:
        outcome.notes.append(
            f"the config spans {base.parallel.nnodes} nodes; the trials ran on this one ({space.world_size} "
            f"rank(s)), so the winner is the layout of one node (parallel.nnodes 1, nproc_per_node "
            f"{space.world_size})"
        )
    best_config, lr_note = None, ""
    best_path = out_dir / "best.yaml"
    if outcome.best is not None:
        best_config, lr_note = winner_config(base, outcome.best.candidate, space.world_size, config.lr_rule)
        save_yaml(config_dict(best_config), best_path)
    elif best_path.is_file():
        # best.yaml is always the winner of the tune.json beside it: an earlier search's would be trained by mistake
        best_path.unlink()
        outcome.notes.append(f"removed {best_path}: the winner of an earlier search here; this one has none")
    result = TuneResult(outcome, space, config, base, best_config, out_dir, lr_note)
    write_reports(result)
    return result


# -- reports ---------------------------------------------------------------------------------------------------
COLUMNS = ("rank", "config", "status", "tokens/s", "step s", "peak GiB", "estimate GiB", "wall s", "why")


def _row(i: int | None, r: TrialResult, world: int) -> list[str]:
    return [
        str(i) if i is not None else "",
        r.candidate.label(world),
        r.status,
        f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "",
        f"{r.step_time_s:.3f}" if r.step_time_s else "",
        f"{r.peak_memory_bytes / 2**30:.2f}" if r.peak_memory_bytes else "",
        f"{r.estimate_bytes / 2**30:.2f}" if r.estimate_bytes else "",
        f"{r.wall_s:.1f}" if r.ran else "",
        r.reason,
    ]


def write_reports(result: TuneResult) -> None:
    out, world = result.out_dir, result.space.world_size
    ranked = result.outcome.ranked()
    with (out / "trials.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "rank",
                "status",
                "tokens_per_s",
                "step_time_s",
                "peak_memory_bytes",
                "estimate_bytes",
                "wall_s",
                "strategy",
                "precision",
                "global_batch_size",
                "micro_batch_size",
                "accumulation",
                "activation_checkpointing",
                "compile",
                "threads",
                "tp_size",
                "pp_size",
                "pp_split",
                "offload",
                "reason",
            ]
        )
        for i, r in enumerate(ranked, 1):
            c = r.candidate
            writer.writerow(
                [
                    i if r.status == "ok" else "",
                    r.status,
                    r.tokens_per_s or "",
                    r.step_time_s or "",
                    r.peak_memory_bytes or "",
                    r.estimate_bytes or "",
                    round(r.wall_s, 3) if r.ran else "",
                    c.strategy,
                    c.precision,
                    c.global_batch_size,
                    c.micro_batch_size,
                    c.accumulation(world),
                    c.activation_checkpointing,
                    c.compile,
                    c.threads if c.threads is not None else "",
                    c.tp_size,
                    c.pp_size,
                    " ".join(map(str, c.pp_split)),
                    c.offload,
                    r.reason,
                ]
            )
    best = result.best
    report: dict[str, Any] = {
        "space": result.space.describe(),
        "grid_size": len(result.space.candidates()),
        "world_size": world,
        "device": result.space.device,
        "memory_budget_bytes": result.config.memory_budget_bytes,
        "time_budget_s": result.config.time_budget_s,
        "min_gain": result.config.min_gain,
        "lr_rule": result.config.lr_rule,
        "lr_rule_source": LR_RULES[result.config.lr_rule],
        "trials_run": result.outcome.trials_run,
        "trials_cached": result.outcome.trials_cached,
        "wall_s": result.outcome.wall_s,
        "limit": result.outcome.limit,
        "notes": result.outcome.notes,
        "best": best.to_dict() if best else None,
        "best_config": str(out / "best.yaml") if best else None,
        "schedule": result.lr_note,
        "trials": [r.to_dict() for r in ranked],
        "environment": {"python": platform.python_version(), "platform": platform.platform(), "date": _now()},
    }
    (out / "tune.json").write_text(strict_json.dumps(report, indent=2) + "\n")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def print_report(result: TuneResult, console: Console) -> None:
    world = result.space.world_size
    table = Table(title=f"gaudi3 tune: {result.space.describe()}", show_header=True, header_style="bold")
    for col in COLUMNS:
        table.add_column(
            col, justify="right" if col in ("tokens/s", "step s", "peak GiB", "wall s") else "left"
        )
    rank = 0
    for r in result.outcome.ranked():
        if r.status == "ok":
            rank += 1
        table.add_row(*_row(rank if r.status == "ok" else None, r, world))
    console.print(table)
    o = result.outcome
    console.print(
        f"{o.trials_run} trials run ({o.trials_cached} from the cache) of a {len(result.space.candidates())}-point "
        f"space in {o.wall_s:.0f} s",
        highlight=False,
    )
    for note in o.notes:
        console.print(f"note: {note}", highlight=False)
    if result.best is not None:
        c = result.best.candidate
        console.print(
            f"best: {c.label(world)} — {result.best.tokens_per_s:,.0f} tokens/s",
            highlight=False,
            style="bold",
        )
        console.print(f"schedule: {result.lr_note}", highlight=False)
        console.print(f"written: {result.out_dir / 'best.yaml'} (gaudi3 train --config it)", highlight=False)
    console.print(f"limited by {o.limit}", highlight=False)
    console.print(
        f"results: {result.out_dir}/ (tune.json, trials.csv, trials.jsonl, trials/)", highlight=False
    )
