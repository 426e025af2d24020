"""One training process: what `python -m gaudi3_scale.train …` runs in every rank (the workers `gaudi3 train
--nproc-per-node N` starts, or torchrun's), and the steps `gaudi3 train` shares with it when it trains in-process.

The worker is the training loop and nothing above it: it fits, writes the run's outputs, prints where they are and
why it stopped, and exits with the run's code. The benchmark cell result and the text sample after training are
tools (`bench`, `artifacts`) that `gaudi3 train` runs itself, in its own process once the workers are done.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from gaudi3_scale.config.errors import INTERRUPTED_EXIT_CODE, ConfigError, UserInputError, brief, print_error
from gaudi3_scale.config.numbers import check_number, parse_number
from gaudi3_scale.distributed.env import launched_rank
from gaudi3_scale.train.config import RunConfig, config_yaml, resolve_config

if TYPE_CHECKING:
    from gaudi3_scale.train.trainer import GaudiTrainer

__all__ = [
    "FinishedRun",
    "exit_if_stopped",
    "fit_run",
    "main",
    "print_outputs",
    "profile_overrides",
    "stop_when_refused_to_resume",
]


@dataclass(frozen=True)
class FinishedRun:
    trainer: GaudiTrainer
    summary: dict[str, Any]
    exit_code: (
        int  # 0, or why it stopped: budget / spot pause (3, 4), 128 + signal after a preemption checkpoint
    )

    @property
    def is_global_zero(self) -> bool:
        return self.trainer.is_global_zero


REFUSAL_GRACE_S = 5.0  # how long ranks other than 0 wait before they exit on a resume refusal


@contextmanager
def stop_when_refused_to_resume() -> Iterator[None]:
    """A resumed run that has no budget left, or whose spot price is still above the pause threshold, trains
    nothing: rank 0 says so in one line, every rank exits 3 (budget) or 4 (spot pause: `SpotPausedError`)."""
    from gaudi3_scale.metering.live import BudgetExhaustedError

    try:
        yield
    except BudgetExhaustedError as exc:
        if launched_rank() == 0:
            click.echo(str(exc), err=True)
        else:
            # torchrun tears the group down at the first rank's exit: the others give rank 0 the time to say why
            # (a restarted group's spot check fetches a price first), or its line could be cut off unsaid
            time.sleep(REFUSAL_GRACE_S)
        sys.exit(exc.exit_code)


# What gloo and NCCL say when the rank at the other end of a collective is gone (its process or its whole node):
# the connection closed or reset, or NCCL's "remote process exited" / aborted communicator.
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
              "NCCL communicator was aborted", "Broken pipe")  # fmt: skip
# A rank or node lost mid-run, or nodes whose remote mirror is behind: 128 + SIGTERM, restartable, as a hang's
# (health.watchdog.HANG_EXIT_CODE): in distributed.launch's RESTARTABLE_EXIT_CODES, which that module (torch behind
# it) is not imported here to read.
RESTARTABLE_STOP_EXIT_CODE = 128 + signal.SIGTERM


def _lost_peer(exc: BaseException) -> str | None:
    """The backend's line when `exc` (or what it was raised from) is a collective whose other end is gone: a
    torch.distributed error, or a RuntimeError of gloo or NCCL, saying so (a storage upload's "Connection reset by
    peer" is not one)."""
    import torch.distributed as dist

    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        backend = isinstance(seen, dist.DistError) or (
            isinstance(seen, RuntimeError) and ("gloo" in text or "NCCL" in text)
        )
        if backend and any(marker in text for marker in _LOST_PEER):
            # gloo's first sentence, without its source location: "Read error [10.0.0.2]:52927: Connection reset
            # by peer"
            text = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(text.split()))
            return text.split(". ")[0][:200]
        seen = seen.__cause__ or seen.__context__
    return None


@contextmanager
def stop_when_a_peer_is_lost(cfg: RunConfig) -> Iterator[None]:
    """A rank or a whole node that is gone mid-run (killed, its machine lost) fails the others' next collective:
    one line on each of them naming the checkpoint a restart resumes from, and exit 143, restartable (torchrun's
    agent, Kubeflow's ExitCode policy), instead of gloo's traceback and exit 1, which Kubeflow fails the job on."""
    from gaudi3_scale.train.nodes import MirrorBehindError

    try:
        yield
    except MirrorBehindError as exc:
        print_error(f"{exc}: exit {RESTARTABLE_STOP_EXIT_CODE} (restartable)")
        sys.exit(RESTARTABLE_STOP_EXIT_CODE)
    except Exception as exc:
        detail = _lost_peer(exc)
        if detail is None:
            raise
        from gaudi3_scale.checkpoint.manager import CheckpointManager

        latest = CheckpointManager(cfg.output_dir / "checkpoints").pointed()
        here = f"{latest.name} in this node's --out" if latest else "none in this node's --out yet"
        print_error(
            f"lost another rank ({detail}): a rank or a node stopped; exit {RESTARTABLE_STOP_EXIT_CODE} (restartable): run "
            f"the same command on every node to resume from the last committed checkpoint ({here})"
        )
        sys.exit(RESTARTABLE_STOP_EXIT_CODE)


def fit_run(cfg: RunConfig, *, progress: bool) -> FinishedRun:
    from gaudi3_scale.distributed.network import apply_network_preset
    from gaudi3_scale.train.callbacks import preemption_exit_code
    from gaudi3_scale.train.trainer import GaudiTrainer

    # A single process, or a worker of a launcher that is not ours (torchrun -m gaudi3_scale.train): our launcher
    # exported the preset already and a user's exports are never replaced, so this sets nothing twice.
    apply_network_preset(cfg.parallel.network_preset)
    trainer = GaudiTrainer(cfg, progress=progress)
    summary = trainer.fit()
    exit_code = summary.get("stop_exit_code") or preemption_exit_code(summary.get("stop_signal"))
    return FinishedRun(trainer=trainer, summary=summary, exit_code=exit_code)


def print_outputs(run: FinishedRun) -> None:
    """The run's outputs that exist (a run stopped before its first record has no metrics.jsonl, nor a plot)."""
    out_dir = run.trainer.out_dir
    written = [
        name
        for name in ("config.yaml", "metrics.jsonl", "summary.json", "loss.png")
        if (out_dir / name).exists()
    ]
    if run.summary.get("checkpoint"):
        written.append("checkpoints/")
    click.echo(f"outputs: {out_dir}/ ({', '.join(written)})")


def exit_if_stopped(cfg: RunConfig, run: FinishedRun) -> None:
    """A run that stopped early exits with its code and one line saying why (and whether to rerun)."""
    from gaudi3_scale.health.guard import HEALTH_STOP_EXIT_CODE
    from gaudi3_scale.metering.live import STOP_HINTS, stop_line

    summary, exit_code = run.summary, run.exit_code
    if exit_code in STOP_HINTS:
        click.echo(
            stop_line(
                summary["stop_reason"],
                exit_code,
                checkpoint=cfg.checkpoint.enabled and bool(summary.get("checkpoint")),
            ),
            err=True,
        )
        sys.exit(exit_code)
    # the step guard stopped it (train.rollback.guard_stop): nothing saved
    if exit_code == HEALTH_STOP_EXIT_CODE:
        click.echo(
            f"stopped by {summary['stop_reason']}; nothing saved after it; exit {exit_code} (not restartable: a "
            f"restart would meet the same): {summary['stop_hint']}",
            err=True,
        )
        sys.exit(exit_code)
    if exit_code:
        took = summary.get("signal_to_checkpoint_s")
        click.echo(
            f"stopped by {summary.get('stop_reason') or summary['stop_signal']} after step {summary['steps']}; checkpoint committed"
            + (f" {took:.2f} s after the signal" if took is not None else "")
            + f"; exit {exit_code} (restartable): run the same command to resume",
            err=True,
        )
        sys.exit(exit_code)


def profile_overrides(profile: str | None) -> list[str]:
    """`--profile START:END` as the `train.profile_*` overrides (the window is checked with the config)."""
    if profile is None:
        return []
    start_text, sep, end_text = profile.partition(":")
    try:
        start, end = (int(parse_number("--profile", t, integer=True)) for t in (start_text, end_text))
    except ConfigError:
        start = end = -1
    if not (sep and 0 <= start < end):
        raise click.UsageError(
            f"--profile: expected START:END optimizer steps with 0 <= START < END, e.g. 5:10; got {brief(profile)}"
        )
    check_number("--profile", end)  # past 64 bits: the END typed, not the train.profile_num_steps made of it
    return [f"--train.profile_start_step={start}", f"--train.profile_num_steps={end - start}"]


@click.command(
    context_settings={
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        "help_option_names": ["-h", "--help"],
    },
    epilog="Any config field can be set as --section.field VALUE, e.g. --model.num_layers 6.",
)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="run config YAML")
@click.option("--out", "out_dir", help="output directory (default runs/<name>)")
@click.option("--resume", help="auto (default), never, or a checkpoint path")
@click.option(
    "--sample-tokens",
    type=click.IntRange(min=0),
    default=0,
    help="accepted for `gaudi3 train` compatibility: `gaudi3 train` prints the sample, the workers do not",
)
@click.option("--print-config", is_flag=True, help="print the resolved config as YAML and exit")
@click.option("--progress/--no-progress", default=True, help="progress bar and summary table")
@click.option(
    "--profile",
    default=None,
    metavar="START:END",
    help="record optimizer steps START..END-1 with torch.profiler into <out>/profile/",
)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def worker(
    config_path: str | None,
    out_dir: str | None,
    resume: str | None,
    sample_tokens: int,
    print_config: bool,
    progress: bool,
    profile: str | None,
    overrides: tuple[str, ...],
) -> None:
    """Train in this process: one rank of `gaudi3 train --nproc-per-node N`, or of `torchrun -m gaudi3_scale.train`."""
    del sample_tokens  # the launching `gaudi3 train` samples once the workers are done
    cfg = resolve_config(
        config_path, [*overrides, *profile_overrides(profile)], out_dir=out_dir, resume=resume
    )
    if print_config:
        click.echo(config_yaml(cfg), nl=False)
        return
    with stop_when_refused_to_resume(), stop_when_a_peer_is_lost(cfg):
        run = fit_run(cfg, progress=progress)
        if not run.is_global_zero:
            sys.exit(run.exit_code)
        print_outputs(run)
        exit_if_stopped(cfg, run)


def main(argv: Sequence[str]) -> None:
    """Bad input is one `gaudi3: error: …` line and exit 2, as from `gaudi3 train`."""
    try:
        worker.main(args=list(argv), prog_name="python -m gaudi3_scale.train", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("gaudi3: interrupted", err=True)
        sys.exit(INTERRUPTED_EXIT_CODE)
    except click.ClickException as exc:
        print_error(exc.format_message().replace("\n", " "))
        sys.exit(2)
    except UserInputError as exc:
        print_error(str(exc))
        sys.exit(2)
