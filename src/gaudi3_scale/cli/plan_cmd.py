"""`gaudi3 plan`: the forecast of a run config (forecast/), or its error against a finished run (`--compare RUN`).

Exit 0 with the forecast (printed, and written as JSON to `--out`, default <run dir>/plan.json); 2 on bad input
(an unknown machine, a layout the trainer cannot build, `--compare` on a run without a summary), nothing written.
A probe that fails is one warning line and the forecast comes from the catalog.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import click

from gaudi3_scale.cli.options import Count
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.config.files import check_output_dir
from gaudi3_scale.config.numbers import MAX_WORLD_SIZE

__all__ = ["plan"]


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    epilog="Any config field can be set as --section.field VALUE, as for `gaudi3 train`.",
)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="run config YAML to forecast")
@click.option(
    "--machine",
    help="forecast for a catalog accelerator (h100, h200, a100, gaudi3, …; see `gaudi3 cost compare`) instead of "
    "this machine",
)
@click.option(
    "--nodes", type=Count(high=MAX_WORLD_SIZE), help="nodes of --machine (default: parallel.nnodes)"
)
@click.option(
    "--probe", is_flag=True, help="run the config briefly on this machine first and forecast from it"
)
@click.option("--refresh-peak", is_flag=True,
              help="measure this CPU's peak FLOP/s again and replace the stored one (else the best is kept)")  # fmt: skip
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path),
              help="write the forecast JSON here (default: <run dir>/plan.json)")  # fmt: skip
@click.option("--compare", "compare_run", type=click.Path(file_okay=False, path_type=Path),
              help="a finished run's directory: print each predicted quantity against its measurement")  # fmt: skip
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def plan(
    config_path: str | None,
    machine: str | None,
    nodes: int | None,
    probe: bool,
    refresh_peak: bool,
    out_path: Path | None,
    compare_run: Path | None,
    overrides: tuple[str, ...],
) -> None:
    """Predict a run's per-rank memory, step time, tokens/s, wall time, energy and cost, each with its source."""
    if compare_run is not None:
        given = [flag for flag, value in (("--out", out_path), ("--machine", machine), ("--nodes", nodes),
                                          ("--probe", probe), ("--refresh-peak", refresh_peak)) if value]  # fmt: skip
        if given:
            raise UserInputError(f"{given[0]}: not with --compare, which reads the run's own predictions and "
                                 "measurements; drop one of them")  # fmt: skip
        _compare(compare_run, config_path, overrides)
        return
    from gaudi3_scale.forecast.report import format_forecast
    from gaudi3_scale.forecast.run import forecast_config, resolve_forecast_config

    if machine is not None and probe:
        raise UserInputError("--probe: runs on this machine; drop --machine to probe here, or --probe to "
                             "forecast for the catalog's accelerator")  # fmt: skip
    if refresh_peak and machine is not None:
        raise UserInputError("--refresh-peak: measures this machine's peak; drop --machine to measure here, or "
                             "--refresh-peak to forecast for the catalog's accelerator")  # fmt: skip
    if nodes is not None and machine is None:
        raise UserInputError("--nodes: only with --machine (this machine's geometry is parallel.nnodes × "
                             "parallel.nproc_per_node)")  # fmt: skip
    # Where the forecast goes is checked before a probe's minutes, before the CPU's peak is measured, before a
    # line is printed; the default path is the forecast config's out_dir (the config alone: no data read).
    if out_path is not None:
        _check_plan_path(out_path)
        path = out_path
    else:
        path = _default_plan_path(resolve_forecast_config(config_path, overrides, machine, nodes).output_dir)
    _cfg, forecast = forecast_config(
        config_path, overrides, machine=machine, nodes=nodes, probe=probe, refresh_peak=refresh_peak,
        warn=lambda line: click.echo(f"gaudi3: warning: {line}", err=True),
    )  # fmt: skip
    _write_plan(path, forecast.as_dict(), field="--out" if out_path is not None else "out_dir")
    for line in format_forecast(forecast):
        click.echo(line)
    click.echo(f"wrote {path}")


def _check_plan_path(path: Path, *, field: str = "--out") -> None:
    """Where the forecast goes: a file whose directory can be made and written (`--out`, default
    <out_dir>/plan.json), or a device or FIFO that can be written (`--out /dev/null`, written through)."""
    from gaudi3_scale.config.atomic import writes_through
    from gaudi3_scale.verify.node_checks import write_problem

    if path.is_dir():
        raise UserInputError(f"{field}: {str(path)!r} is a directory; pass the JSON file to write")
    if writes_through(path):
        if not os.access(path, os.W_OK):
            raise UserInputError(
                f"{field}: {str(path)!r} cannot be written; pass a JSON file in a writable directory"
            )
        return
    # a link's file is replaced, not the link: the file must be writable where it is
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    check_output_dir(field, target.parent)
    if problem := write_problem(target.parent):
        raise UserInputError(f"{field}: {str(path)!r}: {problem}; pass a JSON file in a writable directory")


def _default_plan_path(out_dir: Path) -> Path:
    """<out_dir>/plan.json, refused when out_dir holds a run: its plan.json is the forecast it runs with."""
    _check_plan_path(out_dir / "plan.json", field="out_dir")
    if state := _run_state(out_dir):
        raise UserInputError(
            f"out_dir: {str(out_dir)!r} holds a run that {state}; its plan.json is the forecast it ran with (what "
            "--compare and the calibration store read): pass --out FILE to write this one elsewhere"
        )
    return out_dir / "plan.json"


def _run_state(out_dir: Path) -> str | None:
    """How `out_dir` holds a training run, or None. A plan.json alone is an earlier `gaudi3 plan`'s (a run writes
    config.yaml before it and holds its lock from its start), so planning again replaces it."""
    from gaudi3_scale.checkpoint.manager import LATEST_NAME
    from gaudi3_scale.train.run_lock import lock_path

    if (out_dir / "summary.json").is_file():
        return "has trained"
    locks = [lock_path(out_dir), *out_dir.glob(".run.node*.lock")]
    if any(_held(lock) for lock in locks):
        return "is training now"
    ckpts = out_dir / "checkpoints"
    files = ["config.yaml", "metrics.jsonl", *(p.name for p in locks if p.exists())]
    found = next((name for name in files if (out_dir / name).exists()), None)
    if found is None and ((ckpts / LATEST_NAME).is_file() or any(p.is_dir() for p in ckpts.glob("step-*"))):
        found = "checkpoints/"
    return None if found is None else f"started and did not finish ({found}, no summary.json)"


def _held(lock: Path) -> bool:
    """Whether a run holds `lock` (`train.run_lock`: its members hold it shared, so an exclusive try fails)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the lock this try may have taken
    return False


def _write_plan(path: Path, forecast: dict[str, object], *, field: str) -> None:
    from gaudi3_scale.config import strict_json
    from gaudi3_scale.config.atomic import write_text_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, strict_json.dumps(forecast, indent=2) + "\n")
    except OSError as exc:  # after the checks above: a disk that filled up, a mount that went read-only
        raise UserInputError(f"{field}: cannot write {str(path)!r} ({exc.strerror or exc})") from None


def _compare(run_dir: Path, config_path: str | None, overrides: tuple[str, ...]) -> None:
    from gaudi3_scale.forecast.report import compare_with_run, format_comparison, read_run_summary

    if config_path or overrides:
        raise UserInputError(
            "--compare: takes the run's own config (RUN/config.yaml); drop --config and overrides"
        )
    summary = read_run_summary(run_dir)
    predicted = {k: v for k, v in summary.items() if k.startswith("predicted_")}
    if not predicted:
        raise UserInputError(f"--compare: {run_dir}/summary.json has no predicted_* fields (a run trained without "
                             "a forecast: its gaudi3 train printed a note saying why, or it predates the forecast); "
                             f"forecast its config with gaudi3 plan --config {run_dir}/config.yaml")  # fmt: skip
    for line in format_comparison(compare_with_run(predicted, summary)):
        click.echo(line)
    source = summary.get("predicted_step_time_source")
    if source:
        click.echo(f"the step time was predicted from: {source}")
