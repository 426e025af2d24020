"""`gaudi3 train`: fit, then show a sample of what the model learned.

Exit codes: 0 done (or stopped by Ctrl-C), 2 bad input (another run holding the output directory included), 3
cost.budget_usd reached, 4 paused by the spot policy (both with a committed checkpoint; not restartable on purpose,
see `metering.live`), 128 + signal after a preemption checkpoint (restartable). The same with several ranks: the
launcher passes SIGTERM, SIGUSR1 and Ctrl-C on to them and exits as they do.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import click

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.train.config import RunConfig
from gaudi3_scale.train.worker import (
    exit_if_stopped,
    fit_run,
    print_outputs,
    stop_when_a_peer_is_lost,
    stop_when_refused_to_resume,
)

__all__ = ["print_dry_run", "run_training"]


def run_training(cfg: RunConfig, worker_args: Sequence[str], *, sample_tokens: int, progress: bool) -> None:
    from gaudi3_scale.distributed.env import inside_launched_worker

    with stop_when_refused_to_resume(), _forecast_for_the_run(cfg, here=not inside_launched_worker()):
        if cfg.parallel.world_size > 1 and not inside_launched_worker():
            if _launch_ranks(cfg, worker_args):  # rank 0 ran on this node
                _after_launched_run(cfg, sample_tokens=sample_tokens)
            return
        with stop_when_a_peer_is_lost(
            cfg
        ):  # a rank of a launcher that is not ours (torchrun -m gaudi3_scale.cli)
            _train_here(cfg, sample_tokens=sample_tokens, progress=progress)


@contextlib.contextmanager
def _forecast_for_the_run(cfg: RunConfig, *, here: bool) -> Iterator[None]:
    """The run's forecast (`gaudi3 plan` without a probe; the calibration store's probe of this layout when it has
    one), handed to the trainer of rank 0 through a file named by GAUDI3_FORECAST (inherited by our launcher's
    ranks): it writes <run>/plan.json once the run is past its refusals (the dashboard draws it while the run
    trains) and puts the predicted_* fields beside the measured ones in summary.json. A forecast that fails is one note; the run goes on without one."""
    if not here:
        yield
        return
    from gaudi3_scale.forecast.calibration import CalibrationStoreError

    try:
        from gaudi3_scale.forecast.run import forecast_for_training
        from gaudi3_scale.train.preflight import check_resume_config
        from gaudi3_scale.tune.estimate_table import resolved_model

        check_resume_config(cfg)  # a resume the run will refuse opens no dataset for its forecast
        forecast = forecast_for_training(cfg, resolved_model(cfg.model, cfg.data)).as_dict()
    except CalibrationStoreError as exc:  # input of the forecast's alone: the run never reads the store
        click.echo(f"gaudi3: note: no forecast for this run ({exc})", err=True)
        yield
        return
    except UserInputError:  # bad input the run itself reports, in its one line, when it checks its inputs
        yield
        return
    except Exception as exc:  # a forecast never stops a run
        click.echo(f"gaudi3: note: no forecast for this run ({type(exc).__name__}: {exc})", err=True)
        yield
        return
    from gaudi3_scale.config import strict_json
    from gaudi3_scale.train.forecast_file import FORECAST_ENV

    with tempfile.TemporaryDirectory(prefix="gaudi3-forecast-") as tmp:
        path = Path(tmp) / "plan.json"
        path.write_text(strict_json.dumps(forecast, indent=2) + "\n")
        previous = os.environ.get(FORECAST_ENV)
        os.environ[FORECAST_ENV] = str(path)
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(FORECAST_ENV, None)
            else:
                os.environ[FORECAST_ENV] = previous


def _launch_ranks(cfg: RunConfig, worker_args: Sequence[str]) -> bool:
    """Start this node's ranks (`python -m gaudi3_scale.train`) and wait for them; returns whether rank 0 was one."""
    from gaudi3_scale.checkpoint.manager import checkpoint_directory
    from gaudi3_scale.checkpoint.manifest import hand_down_verified
    from gaudi3_scale.device.select import check_device_precision
    from gaudi3_scale.distributed.launch import launch
    from gaudi3_scale.train.preflight import check_run_inputs, resume_point
    from gaudi3_scale.train.run_lock import run_directory_lock

    # Here, not in the run config: `auto` is this machine's device, and a config is also planned for others (plan).
    check_device_precision(cfg.train.device, cfg.train.precision)
    check_run_inputs(cfg)
    # The launcher holds the run directory for its ranks (they join its lock): a second run is refused here.
    with run_directory_lock(cfg.output_dir, node_rank=cfg.parallel.node_rank):
        ckpt = resume_point(cfg, warn=lambda message: None)  # the workers name skipped checkpoints
        if ckpt is not None:  # verified here: the ranks need not hash it again
            hand_down_verified(checkpoint_directory(ckpt))
        return launch(cfg.parallel, worker_args)


def _train_here(cfg: RunConfig, *, sample_tokens: int, progress: bool) -> None:
    """A single process, or a worker of a launcher that is not ours running `gaudi3 train` itself."""
    run = fit_run(cfg, progress=progress)
    if not run.is_global_zero:
        sys.exit(run.exit_code)
    plan = run.trainer.device_plan
    if cfg.benchmark.result and not run.exit_code and plan is not None:
        from gaudi3_scale.bench.cell import emit_run_result

        emit_run_result(
            run.trainer.config,
            run.trainer.out_dir,
            precision=plan.precision_name,
            accelerator=plan.accelerator,
        )
    print_outputs(run)
    encoder = run.trainer.config.model.arch == "bert"  # an encoder has no text to sample
    if sample_tokens > 0 and run.summary.get("checkpoint") and not run.exit_code and not encoder:
        _print_sample(run.summary["checkpoint"], sample_tokens, seed=cfg.seed)
    exit_if_stopped(cfg, run)


def _after_launched_run(cfg: RunConfig, *, sample_tokens: int) -> None:
    """The benchmark result and the text sample of a run whose ranks all finished (a stopped or failed run exits
    from `launch`). The workers (`python -m gaudi3_scale.train`) are the training loop and do not reach up to
    these tools, so the launcher of the node where rank 0 ran does them from its `summary.json` (once, even when
    the nodes share `--out`)."""
    summary_path = cfg.output_dir / "summary.json"
    if not summary_path.is_file():
        return
    summary = json.loads(summary_path.read_text())
    if cfg.benchmark.result:
        from gaudi3_scale.bench.cell import emit_run_result
        from gaudi3_scale.device.select import plan_device

        plan = plan_device(cfg.train.device, cfg.train.precision, threads=cfg.train.threads or 1)
        emit_run_result(cfg, cfg.output_dir, precision=plan.precision_name, accelerator=plan.accelerator)
    encoder = cfg.model.arch == "bert"  # an encoder has no text to sample
    if sample_tokens > 0 and summary.get("checkpoint") and not encoder:
        _print_sample(summary["checkpoint"], sample_tokens, seed=cfg.seed)


def _print_sample(checkpoint: str | Path, sample_tokens: int, *, seed: int) -> None:
    from gaudi3_scale.artifacts.inference import generate_text, load_for_generation

    model, tokenizer = load_for_generation(checkpoint)
    click.echo("---- sample ----")
    click.echo(generate_text(model, tokenizer, "", max_new_tokens=sample_tokens, seed=seed))


def print_dry_run(cfg: RunConfig) -> None:
    """Build the model on meta, plan its shards and estimate each rank's peak memory; allocate and train nothing.

    The estimate is `tune.memory`'s (the same as `gaudi3 tune --estimate-only`); the parameter shards are counted
    exactly from the meta model (`distributed.shard_plan`).
    """
    import torch

    from gaudi3_scale.distributed.shard_plan import parameter_bytes_per_rank
    from gaudi3_scale.models import build_model
    from gaudi3_scale.models.counting import check_parameter_count
    from gaudi3_scale.tune.estimate_table import resolved_model
    from gaudi3_scale.tune.memory import allocator_retained_bytes, estimate_memory, process_peak_bytes
    from gaudi3_scale.tune.space import device_kind

    started = time.perf_counter()
    model_cfg = resolved_model(cfg.model, cfg.data)
    check_parameter_count(model_cfg, "model")
    with torch.device("meta"):
        model = build_model(model_cfg)
    built_s = time.perf_counter() - started
    batch, plan = cfg.batch_plan(), cfg.parallel_plan(float8=cfg.train.precision == "fp8")
    device = device_kind(cfg)
    estimate = estimate_memory(model_cfg, plan, batch, precision=cfg.train.precision, device_kind=device)
    weight_bytes = 2 if estimate.precision == "bf16-true" else 4
    shards = parameter_bytes_per_rank(model, plan, element_bytes=weight_bytes)
    gib = 2**30
    count = sum(p.numel() for p in model.parameters())
    click.echo(
        f"dry run: {model_cfg.name} ({count / 1e9:.3g} B parameters, built on meta in {built_s:.2f} s), "
        f"{plan.strategy} on {plan.world_size} rank(s) ({cfg.parallel.nnodes} node(s)), {estimate.precision}, "
        f"{device}; batch {batch.global_batch_size} = micro-batch {batch.micro_batch_size} × accumulation "
        f"{batch.accumulation} × {batch.data_parallel_size} rank(s), context {model_cfg.context_length}"
    )
    if plan.shards_parameters or plan.offload != "none":
        click.echo(
            f"layout: tensor parallel {plan.tp_size} × HSDP replicas {plan.dp_replicate} × shards "
            f"{plan.dp_shard if plan.shards_parameters else 1}, offload {plan.offload}"
        )
    click.echo(
        f"parameters per rank: {shards[0] / gib:.2f} GiB on rank 0, {min(shards) / gib:.2f}–{max(shards) / gib:.2f} "
        f"GiB over the ranks ({weight_bytes}-byte weights; whole model {count * weight_bytes / gib:.2f} GiB)"
        + (", held in host memory (offload all)" if plan.offload == "all" else "")
    )
    parts = ", ".join(f"{name} {size / gib:.2f}" for name, size in estimate.rows())
    pipeline = (
        f" on pipeline rank {estimate.pp_rank} (the largest; stages {', '.join(map(str, estimate.pp_stages))}, "
        f"{estimate.in_flight_micro_batches} micro-batch(es) in flight under {estimate.pp_schedule})"
        if estimate.pp_size > 1
        else ""
    )
    click.echo(
        f"estimated peak per rank{pipeline}: {estimate.total_bytes / gib:.2f} GiB at {estimate.peak_phase} ({parts} "
        "GiB; " + ("activations as torch.compile saves them; " if estimate.compiled else "") + "tune.memory)"
    )
    if kept := allocator_retained_bytes(estimate):
        click.echo(
            f"peak resident set per rank: {process_peak_bytes(estimate) / gib:.2f} GiB (with the {kept / gib:.2f} "
            "GiB of freed memory glibc keeps: what a memory budget, tune's trials and gaudi3 plan count on a CPU)"
        )
    if plan.offload != "none":
        per_node = estimate.host_bytes * cfg.parallel.nproc_per_node
        click.echo(
            f"offloaded to host memory: {estimate.host_bytes / gib:.2f} GiB per rank, {per_node / gib:.2f} GiB per "
            f"node of {cfg.parallel.nproc_per_node} rank(s)"
            + (" (on a CPU the host is the device: nothing moves)" if device == "cpu" else "")
        )
    if model_cfg.init_from is not None:
        click.echo(
            f"weights: model.init_from {model_cfg.init_from} (each rank reads only its shards' blocks)"
        )
    click.echo("nothing was allocated, written or trained")
