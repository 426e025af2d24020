"""`gaudi3 health RUN_DIR`: what the hang watchdog recorded, per rank (health/report.py does the reading).

Exit 0 with the report, damaged files included as `damaged:` lines; 2 when RUN_DIR does not exist, has no health/
directory (nor a health event in metrics.jsonl), or nothing in it is readable.
"""

from __future__ import annotations

from pathlib import Path

import click

__all__ = ["health"]


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
def health(run_dir: Path) -> None:
    """Print the hangs found in a run and, per rank, its last heartbeat and the top frames of its stack dumps."""
    from gaudi3_scale.health.report import format_health, read_health

    for line in format_health(read_health(run_dir)):
        click.echo(line)
