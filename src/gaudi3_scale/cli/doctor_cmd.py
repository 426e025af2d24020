"""`gaudi3 doctor`: check this node before a training run (verify/doctor.py), and the same check run by
`gaudi3 train` inside the training image before it starts any rank.

Exit 0: no check FAILed (WARNs allowed); 1: a check FAILed; 2: bad input (an unknown check name, a bad config).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import click

from gaudi3_scale.cli.options import launch_overrides
from gaudi3_scale.verify.doctor import BEFORE_TRAIN_ENV, CHECKS, SKIP_ENV, SKIPPED_BEFORE_TRAIN

__all__ = ["doctor", "doctor_before_training"]


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    epilog="Any config field can be set as --section.field VALUE, as for `gaudi3 train`.",
)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="run config YAML")
@click.option(
    "--out", "out_dir", help="the run's output directory (default runs/<name>): disk and write checks"
)
@click.option(
    "--rdzv-endpoint",
    help="HOST:PORT of the rendezvous to connect to (default: parallel.rdzv_endpoint, else MASTER_ADDR:MASTER_PORT)",
)
@click.option(
    "--check",
    "only",
    multiple=True,
    metavar="NAME",
    help=f"run only this check (repeatable): {', '.join(CHECKS)}",
)
@click.option("--skip", multiple=True, metavar="NAME", help="leave this check out (repeatable)")
@click.option("--json", "as_json", is_flag=True, help="print a JSON list of {check, status, detail, fix}")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def doctor(
    config_path: str | None,
    out_dir: str | None,
    rdzv_endpoint: str | None,
    only: tuple[str, ...],
    skip: tuple[str, ...],
    as_json: bool,
    overrides: tuple[str, ...],
) -> None:
    """Check this node before training: accelerator, network, limits, disk, clock, versions, endpoints."""
    from gaudi3_scale.train.config import resolve_config
    from gaudi3_scale.verify.doctor import doctor_inputs, exit_code, run_checks, select_checks

    names = select_checks(only, skip)  # an unknown name: one line, exit 2, before any work
    cfg = resolve_config(
        config_path, [*overrides, *launch_overrides({"rdzv_endpoint": rdzv_endpoint})], out_dir=out_dir
    )
    findings = run_checks(doctor_inputs(cfg), names)
    if as_json:
        click.echo(json.dumps([f.as_dict() for f in findings], indent=2))
    else:
        for finding in findings:
            click.echo(finding.line())
        counts = {status: sum(f.status == status for f in findings) for status in ("OK", "WARN", "FAIL")}
        click.echo("doctor: " + ", ".join(f"{n} {status}" for status, n in counts.items()))
    sys.exit(exit_code(findings))


def doctor_before_training(config_path: str | None, out_dir: str | None, overrides: Sequence[Any]) -> None:
    """In the training image (GAUDI3_DOCTOR_BEFORE_TRAIN=1), run `gaudi3 doctor` on the run's config before any
    rank starts; its lines go to the log, and a FAIL stops `gaudi3 train` with exit 1. GAUDI3_SKIP_DOCTOR=1 skips it.

    A subprocess, not a call: the check imports the accelerator runtime, which must not be held by the launcher
    whose ranks open the devices next. Inside a rank of some other launcher it does not run (the launcher's node
    was checked, or is not ours to check).
    """
    from gaudi3_scale.distributed.env import inside_launched_worker

    if os.environ.get(BEFORE_TRAIN_ENV) != "1" or os.environ.get(SKIP_ENV) == "1" or inside_launched_worker():
        return
    command = [
        sys.executable,
        "-m",
        "gaudi3_scale.cli",
        "doctor",
        *(f"--skip={n}" for n in SKIPPED_BEFORE_TRAIN),
    ]
    command += [*(["--config", config_path] if config_path else []), *(["--out", out_dir] if out_dir else [])]
    sys.stdout.flush()
    done = subprocess.run([*command, *map(str, overrides)], check=False)
    if done.returncode != 0:
        click.echo(
            f"gaudi3 train: the node check (gaudi3 doctor) failed, so training did not start; fix what it says, "
            f"or set {SKIP_ENV}=1 to train without it",
            err=True,
        )
        sys.exit(1)


def doctor_once_for_trainings(config_path: str | None, overrides: Sequence[Any]) -> None:
    """Tools that start many `gaudi3 train` processes (tune, repro, benchmark run) check the node once, before the
    first, in the training image; their trainings then skip it (each check costs seconds, and the node is the same)."""
    if os.environ.get(BEFORE_TRAIN_ENV) == "1":  # nothing to hand down elsewhere
        doctor_before_training(config_path, None, overrides)
        os.environ[SKIP_ENV] = "1"
