"""`gaudi3 train`: fit, then show a sample of what the model learned.

Exit codes: 0 done (or stopped by Ctrl-C), 2 bad input (another run holding the output directory included), 3
cost.budget_usd reached, 4 paused by the spot policy (both with a committed checkpoint; not restartable on purpose,
see `metering.live`), 128 + signal after a preemption checkpoint (restartable). The same with several ranks: the
launcher passes SIGTERM, SIGUSR1 and Ctrl-C on to them and exits as they do.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import click

from gaudi3_scale.train.config import RunConfig

__all__ = ["run_training"]


def run_training(cfg: RunConfig, worker_args: Sequence[str], *, sample_tokens: int, progress: bool) -> None:
    from gaudi3_scale.metering.live import BudgetExhaustedError

    try:
        _run_training(cfg, worker_args, sample_tokens=sample_tokens, progress=progress)
    except BudgetExhaustedError as exc:  # a resumed run that has no budget left: nothing was trained
        if int(os.environ.get("RANK", "0")) == 0:
            click.echo(str(exc), err=True)
        sys.exit(exc.exit_code)


def _run_training(cfg: RunConfig, worker_args: Sequence[str], *, sample_tokens: int, progress: bool) -> None:
    from gaudi3_scale.distributed.launch import inside_launched_worker, launch
    from gaudi3_scale.metering.live import STOP_HINTS, check_cost_config, stop_line
    from gaudi3_scale.monitor.trackers import check_trackers

    if cfg.parallel.world_size > 1 and not inside_launched_worker():
        from gaudi3_scale.config.core import to_dict
        from gaudi3_scale.train.cost_callback import check_resume_budget
        from gaudi3_scale.train.inference import read_checkpoint
        from gaudi3_scale.train.resume import check_resume_strategy, resume_checkpoint
        from gaudi3_scale.train.run_lock import run_directory_lock

        # What the workers would refuse, refused once here: one line instead of one per rank plus the launcher's.
        # (The model section and the data are compared in the workers, once the dataset is prepared.)
        if cfg.checkpoint.remote_url:
            from gaudi3_scale.checkpoint.remote import open_remote

            open_remote(cfg.checkpoint.remote_url)  # a bad URL: one line here, not one from rank 0 alone
        check_cost_config(cfg.cost)
        check_trackers(cfg.monitor)
        # The launcher holds the run directory for its ranks (they join its lock): a second run is refused here.
        with run_directory_lock(cfg.output_dir, node_rank=cfg.parallel.node_rank):
            ckpt = resume_checkpoint(cfg, warn=lambda message: None)  # the workers name skipped checkpoints
            if ckpt is not None:
                check_resume_strategy(
                    read_checkpoint(ckpt, mmap=True, verify=False), to_dict(cfg)["parallel"]
                )
                check_resume_budget(cfg, ckpt)
            launch(cfg.parallel, worker_args)
        return
    from gaudi3_scale.distributed.network import apply_network_preset
    from gaudi3_scale.train import GaudiTrainer
    from gaudi3_scale.train.callbacks import preemption_exit_code

    # A single process, or a worker of a launcher that is not ours (torchrun -m gaudi3_scale.train): our launcher
    # exported the preset already and a user's exports are never replaced, so this sets nothing twice.
    apply_network_preset(cfg.parallel.network_preset)
    from gaudi3_scale.train.inference import generate_text, load_for_generation

    trainer = GaudiTrainer(cfg, progress=progress)
    summary = trainer.fit()
    exit_code = summary.get("stop_exit_code") or preemption_exit_code(summary.get("stop_signal"))
    if trainer.trainer is not None and not trainer.trainer.is_global_zero:
        sys.exit(exit_code)
    if cfg.benchmark.result and not exit_code and trainer.device_plan is not None:
        from gaudi3_scale.bench.cell import emit_run_result

        plan = trainer.device_plan
        emit_run_result(
            trainer.config, trainer.out_dir, precision=plan.precision_name, accelerator=plan.accelerator
        )
    written = "config.yaml, metrics.jsonl, summary.json, loss.png" + (
        ", checkpoints/" if summary.get("checkpoint") else ""
    )
    click.echo(f"outputs: {trainer.out_dir}/ ({written})")
    if sample_tokens > 0 and summary.get("checkpoint") and not exit_code:
        model, tokenizer = load_for_generation(summary["checkpoint"])
        click.echo("---- sample ----")
        click.echo(generate_text(model, tokenizer, "", max_new_tokens=sample_tokens, seed=cfg.seed))
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
    if exit_code:
        took = summary.get("signal_to_checkpoint_s")
        click.echo(
            f"stopped by {summary.get('stop_reason') or summary['stop_signal']} after step {summary['steps']}; checkpoint committed"
            + (f" {took:.2f} s after the signal" if took is not None else "")
            + f"; exit {exit_code} (restartable): run the same command to resume",
            err=True,
        )
        sys.exit(exit_code)
