"""`gaudi3 repro`: train the same run twice (or continuous vs stopped-and-resumed) and diff the results bitwise.

Exit 0: identical; 1: a difference (the first one is printed); 2: bad input, or a training run that failed.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gaudi3_scale.cli.options import Count, check_new_out_dir, launch_options, launch_overrides
from gaudi3_scale.config import strict_json
from gaudi3_scale.config.errors import UserInputError, print_error

if TYPE_CHECKING:
    from rich.console import Console

    from gaudi3_scale.verify.repro import Comparison, ReproPlan, RunSpec

__all__ = ["repro"]

REPORT_NAME = "repro.json"


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    epilog="Any config field can be set as --section.field VALUE, as for `gaudi3 train`; both runs get the same.",
)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="run config YAML")
@click.option(
    "--steps",
    type=Count(),
    help="optimizer steps per run (default: the config's train.max_steps)",
)
@click.option(
    "--mode",
    # = verify.repro.MODES (a test checks), spelled out because importing that module loads torch
    type=click.Choice(["twice", "resume"]),
    default="twice",
    show_default=True,
    help="twice: runs A and B from scratch; resume: A continuous, B resumed from A's step N//2 checkpoint",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="new or empty directory for run-a/, run-b/ and repro.json (default: a new temporary directory)",
)
@click.option(
    "--keep", is_flag=True, help="keep run-a/ and run-b/ when identical (a difference always keeps them)"
)
@launch_options
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def repro(
    config_path: str | None,
    steps: int | None,
    mode: str,
    out_dir: Path | None,
    keep: bool,
    overrides: tuple[str, ...],
    **launch: Any,
) -> None:
    """Train twice with the same config and seed and compare per-step losses and the final checkpoint bitwise."""
    from gaudi3_scale.cli.doctor_cmd import doctor_once_for_trainings
    from gaudi3_scale.train.config import resolve_config
    from gaudi3_scale.verify.repro import plan_runs

    if out_dir is not None:
        check_new_out_dir(out_dir)
    user_overrides = [*overrides, *launch_overrides(launch)]
    cfg = resolve_config(config_path, user_overrides)
    if not steps and cfg.train.max_epochs is not None:
        raise UserInputError(
            f"--steps: the config trains train.max_epochs {cfg.train.max_epochs}; repro compares a fixed number of "
            "optimizer steps: pass --steps N"
        )
    # Created only once the input is known good; pid + time make the default name unique.
    stamp = f"gaudi3-repro-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    directory = out_dir or Path(tempfile.gettempdir()) / stamp
    plan = plan_runs(mode, steps or cfg.train.max_steps, directory, remote_url=cfg.checkpoint.remote_url)
    # The runs' own config, resolved once here: bad input is one line before anything is trained.
    resolve_config(config_path, [*user_overrides, *plan.overrides()])
    doctor_once_for_trainings(config_path, user_overrides)  # in the training image only
    directory.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"verdict": None, "mode": mode, "steps": plan.steps, "seed": cfg.seed,
                              "note": plan.note, "runs": []}  # fmt: skip
    _run_both(plan, [plan.command(run, config_path, user_overrides) for run in plan.runs], directory, report)
    _finish(plan, directory, report, keep=keep)


def _run_both(plan: ReproPlan, commands: list[list[str]], directory: Path, report: dict[str, Any]) -> None:
    """Run A, then run B; a failed run ends the command with one line and exit 2 (the report says so too)."""
    from rich.console import Console

    console = Console(stderr=True)  # progress; the table and the verdict go to stdout
    for run, command in zip(plan.runs, commands, strict=True):
        code, wall_s = _train(plan, run, command, console)
        log = run.out_dir / "train.log"
        report["runs"].append({"name": run.name, "label": run.label, "out_dir": str(run.out_dir),
                               "command": shlex.join(command), "log": str(log), "exit_code": code,
                               "wall_s": round(wall_s, 2)})  # fmt: skip
        if code != 0:
            message = f"run {run.name} ({run.label}) failed with exit {code}: {_tail(log)}"
            _write_report(directory, {**report, "verdict": "failed", "error": message})
            print_error(f"{message} (log: {log})")
            sys.exit(2)


def _finish(plan: ReproPlan, directory: Path, report: dict[str, Any], *, keep: bool) -> None:
    from gaudi3_scale.checkpoint.contents import DIFF_KEYS
    from gaudi3_scale.verify.repro import compare_runs

    a, b = plan.runs
    comparison = compare_runs(a.out_dir, b.out_dir, first_step=plan.compare_from_step, last_step=plan.steps,
                              keys=DIFF_KEYS)  # fmt: skip
    report["verdict"] = "identical" if comparison.identical else "different"
    report["comparison"] = {**comparison.to_dict(), "checkpoint_keys": list(DIFF_KEYS)}
    path = _write_report(directory, report)
    _print_table(plan, comparison, path)
    if not comparison.identical:
        found = comparison.metrics.describe() if comparison.metrics else None
        if found is None and comparison.checkpoint is not None:
            found = f"checkpoint at step {plan.steps}: {comparison.checkpoint.key}: {comparison.checkpoint.detail}"
        click.echo(f"first difference: {found}; runs kept in {directory}")
        sys.exit(1)
    if not keep:
        for run in plan.runs:
            shutil.rmtree(run.out_dir)


def _train(plan: ReproPlan, run: RunSpec, command: list[str], console: Console) -> tuple[int, float]:
    """One `gaudi3 train` subprocess with a progress bar over its logged steps; (exit code, seconds)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TimeElapsedColumn

    from gaudi3_scale.verify.repro import logged_step, run_training_process

    description = f"run {run.name} ({run.label})"
    start = time.perf_counter()
    columns = (SpinnerColumn(), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    live = console.is_terminal  # a log file gets only the line below
    with Progress(
        "{task.description}", *columns, console=console, transient=True, disable=not live
    ) as progress:
        task = progress.add_task(description, total=plan.steps, completed=run.first_step)

        def poll() -> None:
            progress.update(task, completed=logged_step(run.out_dir) or run.first_step)

        code = run_training_process(command, run.out_dir / "train.log", poll=poll)
    wall_s = time.perf_counter() - start
    if code == 0:  # a failure is one error line, written by the caller
        console.print(f"{description}: steps {run.first_step + 1}-{plan.steps} done in {wall_s:.1f} s")
    return code, wall_s


def _tail(log: Path) -> str:
    """The last line of a failed run's output, without the `gaudi3: error:` prefix it may carry."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].removeprefix("gaudi3: error: ") if lines else "(no output)"


def _write_report(directory: Path, report: dict[str, Any]) -> Path:
    from gaudi3_scale.monitor.environment import environment_info

    path = directory / REPORT_NAME
    path.write_text(strict_json.dumps({**report, "environment": environment_info()}, indent=2) + "\n")
    return path


def _print_table(plan: ReproPlan, comparison: Comparison, report_path: Path) -> None:
    from rich.table import Table

    from gaudi3_scale.cli.config_cmd import wide_console
    from gaudi3_scale.verify.repro import COMPARED_FIELDS

    first, last = comparison.steps.start, comparison.steps.stop - 1
    verdict = "[green]identical[/]" if comparison.identical else "[red]DIFFERENT[/]"
    checkpoint = comparison.checkpoint
    table = Table(title=f"gaudi3 repro --mode {plan.mode}", show_header=False)
    table.add_column("check", style="bold")
    table.add_column("result")
    table.add_row("runs", plan.note)
    table.add_row("steps compared", f"{first}-{last} ({len(comparison.steps)}: {', '.join(COMPARED_FIELDS)})")
    table.add_row("first differing step", comparison.metrics.describe() if comparison.metrics else "none")
    same = "identical (weights, optimizer, sampler, RNG, step guard, step)"
    table.add_row(
        f"checkpoint at step {last}", f"{checkpoint.key}: {checkpoint.detail}" if checkpoint else same
    )
    table.add_row("verdict", verdict)
    table.add_row("report", str(report_path))
    wide_console().print(table)
