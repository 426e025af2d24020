"""The wall time, energy and cost of a forecast run (`forecast.model.forecast_run`): startup, warm-up, steady steps,
and the validation and checkpoint pauses between them; energy at TDP; the bill for the whole wall time and for the
live meter's window (what `cost.budget_usd` is held against)."""

from __future__ import annotations

from gaudi3_scale.checkpoint.config import CheckpointConfig
from gaudi3_scale.forecast.calibration import Probe
from gaudi3_scale.forecast.figures import Figure, assumed, measured, modelled, unknown_after
from gaudi3_scale.forecast.machine import Machine
from gaudi3_scale.forecast.shape import RunShape
from gaudi3_scale.train.train_config import TrainConfig

__all__ = ["metered_seconds", "pause_count", "run_cost", "run_energy", "wall_time", "warmup_steps"]

# Assumptions, said so wherever used. The clock is summary.json's wall_s, from the trainer's start (after the
# launch and the imports): probes on a 2-core EPYC measured 0.5–1.1 s on CPU before the first step (2026-11-29).
STARTUP_S = {"cpu": 1.0, "cuda": 30.0, "hpu": 60.0}
COMPILE_S = {"cpu": 20.0, "cuda": 41.0, "hpu": 60.0}
CHECKPOINT_BYTES_PER_S = (0.52e9, "a synchronous save of gpt2-124m at 0.52 GB/s on a 2-core CI machine "
                          "(benchmarks/results/async_checkpoint_cpu.json, 2026-11-22)")  # fmt: skip
ASYNC_BLOCKING_SHARE = (0.25, "async saves block 0.25× a synchronous one (same file)")
CHECKPOINT_BYTES_PER_PARAMETER = 12  # fp32 weights + AdamW's two fp32 moments


def run_cost(
    price: Figure | None,
    nodes: int,
    seconds: Figure,
    start_step: int,
    spent_usd: float | None,
    *,
    window: str,
) -> Figure:
    """nodes × `seconds` × the price, + what a resumed run's checkpoint had accrued."""
    if price is None or price.value is None:
        return assumed(None, "no price: set cost.instance (catalog) or cost.price_usd_per_hour")
    if seconds.value is None:
        return unknown_after(seconds)
    spent = f" + ${spent_usd:,.2f} accrued before step {start_step} (its checkpoint's)" if spent_usd else ""
    return modelled(
        price.value * nodes * seconds.value / 3600 + (spent_usd or 0.0),
        f"nodes × {window} × {price.source}{spent}",
    )


def metered_seconds(
    wall: dict[str, Figure], train: TrainConfig, checkpoint: CheckpointConfig, start_step: int
) -> Figure:
    """The seconds the live cost meter bills (`cost.budget_usd`, summary.json's cost_usd): from the start of fitting
    to the last step — warm-up, steps, and the validations and saves between steps; not the startup before, nor the
    final validation and save after the last step (the meter accrues at each step's end)."""
    parts = [wall["warmup_s"], wall["steady_s"], wall["validation_s"], wall["checkpoint_s"]]
    if any(p.value is None for p in parts):
        return unknown_after(next(p for p in parts if p.value is None))
    validations = pause_count(start_step, train.max_steps, train.val_every_steps)
    saves = pause_count(start_step, train.max_steps, checkpoint.every_steps) if checkpoint.enabled else 0
    last_validation = (wall["validation_s"].value or 0.0) / validations
    last_save = (wall["checkpoint_s"].value or 0.0) / saves if saves else 0.0
    seconds = sum(p.value or 0.0 for p in parts) - last_validation - last_save
    return modelled(seconds, "the live meter's window: fit start to the last step (warm-up, steps, the pauses "
                    "between steps; not the startup, the final validation or the final save)")  # fmt: skip


def wall_time(
    train: TrainConfig,
    checkpoint: CheckpointConfig,
    shape: RunShape,
    machine: Machine,
    probe: Probe | None,
    step_s: float | None,
    start_step: int,
) -> dict[str, Figure]:
    warm_steps = warmup_steps(train, start_step)
    same = probe is not None and probe.key == shape.key
    kind = shape.device_kind
    untimed = assumed(None, "the step is not timed")
    if same and probe is not None:
        startup = measured(probe.startup_s, probe.source())
        per_warmup = probe.warmup_s / max(probe.warmup_steps, 1)
        warmup = measured(per_warmup * warm_steps, "the probe's warm-up steps")
    else:
        startup = assumed(STARTUP_S[kind], f"startup on {kind} (launch, imports, data, build), not measured")
        extra = COMPILE_S[kind] if shape.plan.compile else 0.0
        compile_s = f" + {extra:g} s compile" if extra else ""
        warmup = (
            untimed
            if step_s is None
            else assumed(warm_steps * step_s * 2 + extra, "warm-up steps at 2× a steady step" + compile_s)
        )
    steps = train.max_steps - start_step
    after = f" (from the resumed step {start_step})" if start_step else ""
    steady = (
        untimed
        if step_s is None
        else modelled((steps - warm_steps) * step_s, f"steps after the warm-up{after} × step time")
    )
    validation = _validations(train, shape, machine, probe if same else None, start_step)
    checkpoints = _checkpoints(checkpoint, start_step, train.max_steps, shape, probe if same else None)
    parts = [startup, warmup, steady, validation, checkpoints]
    unknown = [p for p in parts if p.value is None]
    total = (
        unknown_after(unknown[0])
        if unknown
        else modelled(sum(p.value or 0.0 for p in parts), "the sum of the parts")
    )
    return {"startup_s": startup, "warmup_s": warmup, "steady_s": steady, "validation_s": validation,
            "checkpoint_s": checkpoints, "wall_s": total}  # fmt: skip


def warmup_steps(train: TrainConfig, start_step: int) -> int:
    """The first steps of the process that run slower (a resumed process warms up again)."""
    return min(train.resolved_throughput_warmup_steps(), train.max_steps - start_step)


def pause_count(start_step: int, max_steps: int, every: int) -> int:
    """Pauses in the steps after `start_step` up to `max_steps`, at every multiple of `every`, and always one
    after the last step."""
    if every <= 0:
        return 1
    return max_steps // every - start_step // every + (1 if max_steps % every else 0)


def _validations(
    train: TrainConfig, shape: RunShape, machine: Machine, probe: Probe | None, start_step: int
) -> Figure:
    count = pause_count(start_step, train.max_steps, train.val_every_steps)
    flops = shape.validation_flops_per_rank(train.val_batches)
    per_rank = shape.validation_batches_per_rank(train.val_batches)
    passes = f"{count} pass(es) of {per_rank} micro-batches per rank, forward only"
    if probe is not None:
        # this run's val_batches at the rate the probe measured (not the probe's stored validation_s: that is one
        # pass of the probe's own val_batches, which its key does not hold)
        return modelled(
            count * flops / probe.achieved_flops_per_rank, f"{passes}, at the probe's measured rate"
        )
    peak, mfu = machine.peak_flops_per_rank, machine.mfu
    if peak.value is None or mfu.value is None:
        return unknown_after(peak if peak.value is None else mfu)
    gain = shape.fp8_gain()  # fp8's forward gains as its step does (forecast.model)
    if gain is not None and gain.value is not None:
        return modelled(count * flops / (peak.value * mfu.value * gain.value),
                        f"{passes}, at peak × MFU × the {gain.source.split(': ', 1)[-1]}")  # fmt: skip
    return modelled(count * flops / (peak.value * mfu.value), f"{passes}, at peak × MFU")


def _checkpoints(
    ckpt: CheckpointConfig, start_step: int, max_steps: int, shape: RunShape, probe: Probe | None
) -> Figure:
    if not ckpt.enabled:
        return modelled(0.0, "checkpoints off")
    count = pause_count(start_step, max_steps, ckpt.every_steps)
    probe_async = _probe_async_save(probe)
    if probe is not None and probe.checkpoint_s is not None and probe_async == ckpt.async_save:
        return measured(count * probe.checkpoint_s, f"{count} × the probe's save ({_save_mode(probe_async)})")
    from gaudi3_scale.models.counting import count_parameters

    shard = shape.plan.dp_shard if shape.plan.shards_parameters else 1
    size = (
        count_parameters(shape.model, trainable_only=False)
        * CHECKPOINT_BYTES_PER_PARAMETER
        / shard
        / shape.plan.tp_size
        / shape.plan.pp_size  # a pipeline rank saves its stages
    )
    seconds = size / CHECKPOINT_BYTES_PER_S[0] * (ASYNC_BLOCKING_SHARE[0] if ckpt.async_save else 1.0)
    how = CHECKPOINT_BYTES_PER_S[1] + ("; " + ASYNC_BLOCKING_SHARE[1] if ckpt.async_save else "")
    if probe is not None and probe.checkpoint_s is not None:
        how += (
            f" (the probe's save is not used: it was {_save_mode(probe_async)}, this run's is "
            f"{_save_mode(ckpt.async_save)})"
            if probe_async is not None
            else " (the probe's save is not used: it does not record whether it was asynchronous)"
        )
    return assumed(count * seconds, f"{count} save(s) of {size / 1e9:.3g} GB per rank: {how}")


def _probe_async_save(probe: Probe | None) -> bool | None:
    """The probe's checkpoint.async_save, None where it does not record it (a store written before it did): a
    probe's save is only this run's when both save the same way (an asynchronous save blocks a fraction of a
    synchronous one)."""
    return None if probe is None else probe.checkpoint_async_save


def _save_mode(async_save: bool | None) -> str:
    return "asynchronous" if async_save else "synchronous"


def run_energy(machine: Machine, ranks: int, wall: Figure) -> Figure:
    from gaudi3_scale.metering.catalog import DEFAULT_PUE, PUE_SOURCE

    power = machine.power_w_per_rank
    if power.value is None:
        return assumed(None, f"energy unknown: {power.source.split(': ', 1)[-1]}")
    if wall.value is None:
        return unknown_after(wall)
    kwh = power.value * ranks * wall.value / 3600 * DEFAULT_PUE / 1000
    return modelled(kwh, f"ranks × TDP (an upper bound) × wall time × PUE {DEFAULT_PUE:g} ({PUE_SOURCE})")
