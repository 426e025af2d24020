"""`gaudi3 smoke`: train the tiny default model briefly on CPU, then save, verify, reload and resume from its checkpoint.

Exit 0: every stage passed; 1: a stage failed (`smoke: FAILED at stage <name>: <reason>` on stderr); 2: bad input.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gaudi3_scale.cli.options import Count, check_new_out_dir

if TYPE_CHECKING:
    from gaudi3_scale.verify.smoke import StageResult

__all__ = ["smoke"]

BUDGET_S = 120.0  # the smoke tier's promise: 100 steps + checkpoint round trip in under 2 minutes on CPU


@click.command()
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="new or empty directory for the run (default: a temporary directory, removed afterwards unless --keep)",
)
@click.option("--steps", type=Count(), default=100, show_default=True, help="optimizer steps")
@click.option("--keep", is_flag=True, help="keep the temporary run directory (--out is always kept)")
def smoke(out_dir: Path | None, steps: int, keep: bool) -> None:
    """Smoke test: train, save a checkpoint, verify its checksums, reload it and resume from it; each stage timed."""
    from gaudi3_scale.verify.smoke import run_smoke

    if out_dir is not None:
        check_new_out_dir(out_dir)
    directory = out_dir or Path(tempfile.mkdtemp(prefix="gaudi3-smoke-"))
    directory.mkdir(parents=True, exist_ok=True)
    report = run_smoke(directory, steps, progress_print=_print_stage)
    failed = report.failed
    if failed is not None or not report.ok:
        reason = failed.detail if failed else "not every stage ran"
        click.echo(f"smoke: FAILED at stage {failed.name if failed else '?'}: {reason}", err=True)
        click.echo(f"smoke: run kept in {directory}", err=True)
        sys.exit(1)
    click.echo(f"smoke: all stages ok in {report.total_s:.1f} s (budget {BUDGET_S:.0f} s)")
    if out_dir is None and not keep:
        shutil.rmtree(directory)
    elif out_dir is None:
        click.echo(f"smoke: run kept in {directory}")


def _print_stage(result: StageResult) -> None:
    if result.ok:
        click.echo(f"smoke: {result.name} ok ({result.time_s:.1f} s) {result.detail}")
