"""`gaudi3 benchmark run|collect|report|matrices` (alias `gaudi3-benchmark …`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from gaudi3_scale.cli.options import Seconds
from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.config.files import check_output_dir
from gaudi3_scale.config.numbers import parse_number

__all__ = ["benchmark"]


@click.group()
def benchmark() -> None:
    """Strategy × scale benchmark matrices: run cells as training jobs, collect results from logs, report."""


@benchmark.command(name="run")
@click.option(
    "--matrix", "matrix_spec", required=True, help="matrix YAML, or a shipped name (see `matrices`)"
)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="results directory")
@click.option(
    "--cell-timeout-s", type=Seconds(), help="kill a cell after this many seconds (default: the matrix's)"
)
@click.option(
    "--retry-failed", is_flag=True, help="run failed, OOM and timed-out cells again (ok cells are kept)"
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="validate the matrix and list its cells, on any machine (whether this one can train in its precisions "
    "is checked by the run); run nothing",
)
def run_cmd(
    matrix_spec: str, out_dir: str, cell_timeout_s: float | None, retry_failed: bool, dry_run: bool
) -> None:
    """Run every cell of a matrix (resumable: cells with a result are skipped). Exit 0 when all cells are ok,
    1 when some failed (they are recorded with their reason), 2 on bad input."""
    from gaudi3_scale.bench.matrix import load_matrix
    from gaudi3_scale.bench.runner import check_results_dir, run_matrix
    from gaudi3_scale.cli.config_cmd import wide_console
    from gaudi3_scale.cli.doctor_cmd import doctor_once_for_trainings

    # A cell this machine cannot train in (16-mixed on a CPU) is refused here, not launched to fail; a dry run
    # validates a matrix on any machine (a laptop, before it goes to the GPU nodes).
    matrix, cells = load_matrix(matrix_spec, here=not dry_run)
    console = wide_console()
    if dry_run:
        for cell in cells:
            console.print(f"{cell.id}: {cell.label}", highlight=False)
        console.print(f"matrix {matrix.name}: {len(cells)} cells (dry run: nothing run)", highlight=False)
        return
    check_output_dir("--out", out_dir)
    check_results_dir(matrix, cells, Path(out_dir))  # another matrix's results: refused before any output
    doctor_once_for_trainings(None, [])  # in the training image only
    console.print(f"matrix {matrix.name}: {len(cells)} cells → {out_dir}/cells/", highlight=False)
    outcome = run_matrix(matrix, cells, Path(out_dir), timeout_s=cell_timeout_s, retry_failed=retry_failed,
                         console=console, on_cell=_feed_calibration)  # fmt: skip
    bad = len(cells) - outcome.count("ok")
    console.print(
        f"{len(outcome.ran)} cells run, {len(outcome.skipped)} already done; {outcome.count('ok')} ok, "
        f"{outcome.count('failed')} failed, {outcome.count('oom')} out of memory, {outcome.count('timeout')} timed "
        f"out; next: gaudi3 benchmark report {out_dir} --out {out_dir}/report",
        highlight=False,
    )
    if bad:
        raise SystemExit(1)


def _feed_calibration(result: dict[str, Any], run_dir: Path) -> str:
    """Each cell run now on this machine is a probe of its layout for its calibration store (forecast.feed)."""
    from gaudi3_scale.forecast.feed import feed_run

    return feed_run(run_dir, status=result["status"], origin=f"benchmark cell {run_dir.parent}")


@benchmark.command(name="collect")
@click.argument("logs", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="results directory")
def collect_cmd(logs: tuple[str, ...], out_dir: str) -> None:
    """Recover cell results printed between GAUDI3-BENCHMARK-RESULT markers in LOG files (e.g. pod logs)."""
    from gaudi3_scale.bench.collect import collect_logs, save_collected

    check_output_dir("--out", out_dir)
    results = collect_logs(Path(p) for p in logs)
    if not results:
        raise UserInputError(f"no benchmark result markers in {', '.join(logs)}")
    for line in save_collected(results, Path(out_dir)).lines():
        click.echo(line)


@benchmark.command(name="report")
@click.argument("dirs", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="report directory")
@click.option(
    "--label", "labels", multiple=True, help="a name per DIR, in order (default: the directory names)"
)
@click.option(
    "--price", "prices", multiple=True, help="LABEL=USD_PER_HOUR of the machine a result set ran on"
)
@click.option("--title", default="gaudi3-scale benchmark", show_default=True)
def report_cmd(
    dirs: tuple[str, ...], out_dir: str, labels: tuple[str, ...], prices: tuple[str, ...], title: str
) -> None:
    """CSV, PNG plots, a Markdown and a self-contained HTML report from one or more result directories."""
    from gaudi3_scale.bench.report import write_report

    if labels and len(labels) != len(dirs):
        raise UserInputError(f"--label: give one per directory ({len(dirs)}), got {len(labels)}")
    check_output_dir("--out", out_dir)
    files = write_report([Path(d) for d in dirs], Path(out_dir), labels=list(labels) or None,
                         prices_usd_per_hour=_prices(prices) or None, title=title)  # fmt: skip
    click.echo(f"report: {files.markdown}, {files.html}, {files.csv}, {len(files.plots)} plots in {out_dir}/")


def _prices(items: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        label, sep, value = item.partition("=")
        try:
            price = float(parse_number("--price", value, integer=False))
        except ConfigError:
            price = -1.0
        if not sep or not label or price <= 0:
            raise UserInputError(
                f"--price: expected LABEL=USD_PER_HOUR with a positive price, got {brief(item)}"
            )
        out[label] = price
    return out


@benchmark.command(name="matrices")
def matrices_cmd() -> None:
    """List the shipped matrices."""
    from gaudi3_scale.bench.matrix import list_matrices, load_matrix

    for name in list_matrices():
        matrix, cells = load_matrix(name)
        click.echo(f"{name}: {len(cells)} cells — {matrix.description}")
