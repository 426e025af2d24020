"""The forecast of one run: `forecast_run(cfg, machine)` predicts per-rank peak memory (by part), the step time
(compute + exposed communication), tokens/s, the wall time of `train.max_steps` (startup, warm-up, steady steps,
validation and checkpoint pauses), energy and cost — every number a `Figure` with its source.

Compute time is the step's FLOPs per rank (PaLM's 6·N + 12·L·H·Q·T per token, × 4/3 under activation checkpointing:
each block's forward runs again in backward) over the rank's achieved FLOP/s: a probe's measurement of this very
layout when the calibration store has one (then the step time is the probe's), else the machine's peak × its MFU
(measured on this kind of machine where we have it, an assumption said to be one where not). Communication is the
bytes of the layout's collectives (`forecast.comm`) over the link's bus bandwidth (`links.yaml`); on an accelerator
the data-parallel part overlaps the backward pass (up to 2/3 of compute), tensor parallel does not. Under pipeline
parallel (`forecast.pipeline`) compute is the busiest pipeline rank's stages, the step adds the schedule's bubble
(`bubble_s`), and communication adds the point-to-point traffic between stages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gaudi3_scale.checkpoint.config import CheckpointConfig
from gaudi3_scale.config.core import to_dict
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.forecast.calibration import Probe, probe_key
from gaudi3_scale.forecast.comm import step_collective_bytes
from gaudi3_scale.forecast.figures import Figure, assumed, measured, modelled
from gaudi3_scale.forecast.machine import Machine
from gaudi3_scale.forecast.pipeline import busiest_rank_share, pipeline_bubble, pipeline_p2p
from gaudi3_scale.models import ModelConfig, flops_per_token
from gaudi3_scale.train.train_config import TrainConfig

__all__ = ["Forecast", "RunShape", "forecast_run", "forecast_step", "stored_probe"]

RECOMPUTE_FACTOR = 4 / 3  # activation checkpointing runs each block's forward (1/3 of its FLOPs) once more
BACKWARD_SHARE = 2 / 3  # the part of compute a data-parallel collective can hide behind
# Assumptions, said so wherever used. The clock is summary.json's wall_s, from the trainer's start (after the
# launch and the imports): probes on a 2-core EPYC measured 0.5–1.1 s on CPU before the first step (2026-11-29).
STARTUP_S = {"cpu": 1.0, "cuda": 30.0, "hpu": 60.0}
COMPILE_S = {"cpu": 20.0, "cuda": 41.0, "hpu": 60.0}
CHECKPOINT_BYTES_PER_S = (0.52e9, "a synchronous save of gpt2-124m at 0.52 GB/s on a 2-core CI machine "
                          "(benchmarks/results/async_checkpoint_cpu.json, 2026-11-22)")  # fmt: skip
ASYNC_BLOCKING_SHARE = (0.25, "async saves block 0.25× a synchronous one (same file)")
CHECKPOINT_BYTES_PER_PARAMETER = 12  # fp32 weights + AdamW's two fp32 moments
# tune.memory is calibrated with MALLOC_MMAP_THRESHOLD_=131072, where glibc hands freed tensors back at once. Setting
# it for a run costs speed (every large tensor becomes an mmap and its pages are zeroed again: the default run's
# step was several times slower with it), so runs keep glibc's default, which keeps part of what a step frees. Its
# excess over the estimate, on bench_foresight's 7 CPU cases (2026-11-29): +6 … +28 % of the estimate. 16 % puts
# all 7 within ±10 % (−9.4 … +9.6 %); it is fitted on those cases, so they are not an independent check of it.
GLIBC_RETAINED_SHARE = (0.16, "glibc's default allocator keeps part of what a step frees: +16 % of the estimate "
                        "(fitted on bench_foresight's 7 CPU cases, 2026-11-29)")  # fmt: skip
MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"


@dataclass(frozen=True)
class RunShape:
    """What the forecast is of: the resolved model, the plans and the machine's device."""

    model: ModelConfig
    plan: ParallelPlan
    batch: BatchPlan
    precision: str
    device_kind: str
    nodes: int
    ranks_per_node: int
    # CPU intra-op threads per rank when the config sets other than the run's default (usable cores ÷ ranks): a
    # tune trial with half the threads is another layout. None (the default, and on accelerators) leaves the key
    # as it was before threads were part of it, so stored probes keep matching.
    threads: int | None = None

    @classmethod
    def build(
        cls,
        model: ModelConfig,
        plan: ParallelPlan,
        batch: BatchPlan,
        *,
        precision: str,
        device_kind: str,
        nodes: int,
        ranks_per_node: int,
        threads: int | None = None,
    ) -> RunShape:
        """The shape of a run, its model's vocabulary padding resolved as the trainer resolves it
        (`ModelConfig.resolve_padding` for the device and tensor parallel): a run's saved config.yaml (padding set)
        and the config it came from (padding null) are one layout, with one key."""
        model = model.resolve_padding(device_kind, tp_size=plan.tp_size)
        return cls(model, plan, batch, precision, device_kind, nodes, ranks_per_node, threads)

    def layout(self) -> dict[str, Any]:
        """What decides a step's time and memory: a probe of the same layout measured this very step."""
        plan, batch = self.plan, self.batch
        threads = {} if self.threads is None else {"threads": self.threads}
        return {
            "model": to_dict(self.model),
            "strategy": plan.strategy,
            "world_size": plan.world_size,
            "tp_size": plan.tp_size,
            "dp_replicate": plan.dp_replicate,
            "activation_checkpointing": plan.activation_checkpointing,
            "compile": plan.compile,
            "offload": plan.offload,
            "micro_batch_size": batch.micro_batch_size,
            "accumulation": batch.accumulation,
            "precision": self.precision,
            "device_kind": self.device_kind,
            **threads,
            # only under a pipeline, so that the keys of probes stored before pipelines existed still match
            **(
                {"pp_size": plan.pp_size, "pp_schedule": plan.pp_schedule, "pp_split": list(plan.pp_split)}
                if plan.pipelined
                else {}
            ),
        }

    @property
    def key(self) -> str:
        return probe_key(self.layout())

    def flops_per_step_per_rank(self) -> float:
        """FLOPs of the busiest rank: the step's over the ranks of one pipeline stage, × the share of the model the
        busiest pipeline rank runs (1 without a pipeline)."""
        fpt = flops_per_token(self.model, self.model.context_length)
        factor = RECOMPUTE_FACTOR if self.plan.activation_checkpointing else 1.0
        share = busiest_rank_share(self.model, self.plan, fpt)
        return fpt * self.batch.tokens_per_step * factor * share * self.plan.pp_size / self.plan.world_size

    def validation_flops_per_rank(self, val_batches: int) -> float:
        """One validation pass: `val_batches` micro-batches per rank, forward only (a third of training's FLOPs)."""
        tokens = val_batches * self.batch.micro_batch_size * self.model.context_length
        return flops_per_token(self.model, self.model.context_length) / 3 * tokens / self.plan.tp_size


@dataclass
class Forecast:
    run: dict[str, Any]
    memory: dict[str, Figure]
    step: dict[str, Figure]
    tokens_per_s: Figure
    wall: dict[str, Figure]
    energy_kwh: Figure
    cost_usd: Figure
    sample_memory_bytes: Figure  # the end-of-run text sample (`gaudi3 train --sample-tokens`), host memory
    notes: list[str] = field(default_factory=list)

    @property
    def step_time_s(self) -> float | None:
        return self.step["step_time_s"].value

    @property
    def wall_s(self) -> float | None:
        return self.wall["wall_s"].value

    @property
    def peak_memory_bytes(self) -> float | None:
        return self.memory["total_bytes"].value

    def summary_fields(self) -> dict[str, Any]:
        """The `predicted_*` fields a run's summary.json carries beside its measured values."""
        return {
            "predicted_step_time_s": self.step_time_s,
            "predicted_wall_s": self.wall_s,
            "predicted_peak_memory_bytes": None
            if self.peak_memory_bytes is None
            else int(self.peak_memory_bytes),
            "predicted_tokens_per_s": self.tokens_per_s.value,
            "predicted_cost_usd": self.cost_usd.value,
            "predicted_step_time_source": self.step["step_time_s"].source,
        }

    def as_dict(self) -> dict[str, Any]:
        def figures(group: dict[str, Figure]) -> dict[str, Any]:
            return {name: figure.as_dict() for name, figure in group.items()}

        return {
            "format": "gaudi3-scale/forecast/1",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "run": self.run,
            "memory": figures(self.memory),
            "step": figures(self.step),
            "tokens_per_s": self.tokens_per_s.as_dict(),
            "wall": figures(self.wall),
            "energy_kwh": self.energy_kwh.as_dict(),
            "cost_usd": self.cost_usd.as_dict(),
            "sample_memory_bytes": self.sample_memory_bytes.as_dict(),
            "notes": self.notes,
            **self.summary_fields(),
        }


def forecast_run(
    shape: RunShape,
    machine: Machine,
    *,
    run_name: str,
    train: TrainConfig,
    checkpoint: CheckpointConfig,
    probe: Probe | None = None,
    price_usd_per_node_hour: Figure | None = None,
    start_step: int = 0,
    spent_usd: float | None = None,
) -> Forecast:
    """The forecast of a run of `shape` on `machine` with its `train` and `checkpoint` sections; `probe`: a
    measurement of this layout (by default the calibration store's, when it has one).

    A resumed run (`start_step` > 0, its checkpoint's step) is forecast as summary.json measures it: the wall time
    of this process, steps `start_step` to `train.max_steps`, and the cost accrued in all (`spent_usd`, the
    checkpoint's, plus this process's)."""
    if not 0 <= start_step < train.max_steps:
        raise ValueError(f"start_step {start_step} is outside [0, train.max_steps {train.max_steps})")
    model = shape.model
    probe = probe or stored_probe(shape, machine)
    memory = _memory(shape, probe)
    step = forecast_step(shape, machine, probe)
    step_time = step["step_time_s"].value
    assert step_time is not None
    tokens = modelled(shape.batch.tokens_per_step / step_time, "tokens per step ÷ step time")
    wall = _wall(train, checkpoint, shape, machine, probe, step_time, start_step)
    ranks = shape.plan.world_size
    wall_h = (wall["wall_s"].value or 0.0) / 3600
    energy = _energy(machine, ranks, wall_h)
    spent = f" + ${spent_usd:,.2f} accrued before step {start_step} (its checkpoint's)" if spent_usd else ""
    cost = (
        modelled(
            price_usd_per_node_hour.value * shape.nodes * wall_h + (spent_usd or 0.0),
            f"nodes × wall time × {price_usd_per_node_hour.source}{spent}",
        )
        if price_usd_per_node_hour is not None and price_usd_per_node_hour.value is not None
        else assumed(None, "no price: set cost.instance (catalog) or cost.price_usd_per_hour")
    )
    run = {
        "name": run_name,
        "model": model.name,
        "start_step": start_step,  # a resumed run's checkpoint step: the wall time is from there to max_steps
        "max_steps": train.max_steps,
        # the steps of wall.warmup_s, after start_step (the dashboard's predicted line)
        "warmup_steps": _warmup_steps(train, start_step),
        "machine": machine.kind,
        "device": machine.device_name,
        "nodes": shape.nodes,
        "world_size": ranks,
        "probe_key": shape.key,
        "probed": probe is not None and probe.key == shape.key,
        # the machine whose calibration store this forecast read (None: a catalog machine without one): a run's
        # plan.json says where it ran, so its measurements can feed that store (forecast.feed)
        "calibration_machine": machine.store.machine if machine.store is not None else None,
        "layout": {k: v for k, v in shape.layout().items() if k != "model"},
        "tokens_per_step": shape.batch.tokens_per_step,
        "flops_per_step_per_rank": shape.flops_per_step_per_rank(),
    }
    return Forecast(run, memory, step, tokens, wall, energy, cost, _sample_memory(shape))


def _memory(shape: RunShape, probe: Probe | None) -> dict[str, Figure]:
    from gaudi3_scale.tune.memory import estimate_memory

    estimate = estimate_memory(
        shape.model, shape.plan, shape.batch, precision=shape.precision, device_kind=shape.device_kind
    )
    stage = (
        f"; pipeline rank {estimate.pp_rank} of {estimate.pp_size}, the largest: stages "
        f"{', '.join(map(str, estimate.pp_stages))}, {estimate.in_flight_micro_batches} micro-batch(es) in flight"
        if estimate.pp_size > 1
        else ""
    )
    how = f"tune.memory estimator ({estimate.strategy}, peak at {estimate.peak_phase}{stage})"
    parts = {f"{name}_bytes": modelled(float(value), how) for name, value in estimate.rows()}
    if shape.device_kind == "cpu":  # host memory: what the allocator keeps counts
        import os

        kept = 0.0 if os.environ.get(MMAP_THRESHOLD_ENV) else estimate.total_bytes * GLIBC_RETAINED_SHARE[0]
        parts["allocator_bytes"] = modelled(
            kept, f"{MMAP_THRESHOLD_ENV} is set: freed memory goes back at once" if not kept
            else GLIBC_RETAINED_SHARE[1],
        )  # fmt: skip
    total = modelled(sum(p.value or 0.0 for p in parts.values()), how + " + what the allocator keeps"
                     if "allocator_bytes" in parts else how)  # fmt: skip
    if probe is not None and probe.key == shape.key:
        total = measured(float(probe.peak_memory_bytes), probe.source())
    return {**parts, "total_bytes": total}


def _sample_memory(shape: RunShape) -> Figure:
    """The end-of-run sample of `gaudi3 train` (`--sample-tokens`, on by default) runs in the launching process,
    on the CPU, after training: the process baseline plus the model's fp32 weights twice (built, and the
    checkpoint's memory-mapped weights while they are copied in; the optimizer's state is never read)."""
    from gaudi3_scale.models.counting import count_parameters
    from gaudi3_scale.tune.memory import CPU_RUNTIME_BYTES

    weights = count_parameters(shape.model, trainable_only=False) * 4
    return modelled(
        float(CPU_RUNTIME_BYTES + 2 * weights),
        "host memory of the end-of-run sample (after training, in the launching process): the CPU process "
        "baseline + the fp32 weights twice (the model, and the checkpoint's mapped weights as they load)",
    )


def stored_probe(shape: RunShape, machine: Machine) -> Probe | None:
    """The machine's stored probe of this very layout (a probe, a tune trial or a benchmark cell), or None."""
    return None if machine.store is None else machine.store.probes.get(shape.key)


def forecast_step(shape: RunShape, machine: Machine, probe: Probe | None = None) -> dict[str, Figure]:
    """The step time of `shape` on `machine` (compute, exposed communication, their sum): the one step model
    `gaudi3 plan`, the forecast `gaudi3 train` records and `gaudi3 cost compare` share. `probe`: a measurement of
    this layout, by default the machine's stored one; it replaces the model."""
    probe = probe or stored_probe(shape, machine)
    flops = shape.flops_per_step_per_rank()
    peak, mfu = machine.peak_flops_per_rank, machine.mfu
    assert peak.value is not None and mfu.value is not None
    rate = peak.value * mfu.value
    compute = modelled(flops / rate, f"FLOPs per rank ÷ (peak × MFU {mfu.value:.3f}: {mfu.source})")
    comm = _communication(shape, machine, compute.value or 0.0)
    if probe is not None and probe.key == shape.key:
        step = measured(probe.step_time_s, f"{probe.source()} ({probe.step_time_s:.4g} s)")
        compute = modelled(step.value, "the probe's step (compute and communication together)")
        return {
            "compute_s": compute,
            "communication_s": modelled(0.0, "inside the probe's step"),
            "bubble_s": modelled(0.0, "inside the probe's step"),
            "step_time_s": step,
        }
    bubble = pipeline_bubble(shape.plan, shape.batch.accumulation, compute.value or 0.0)
    total = (compute.value or 0.0) + (comm.value or 0.0) + (bubble.value or 0.0)
    return {"compute_s": compute, "communication_s": comm, "bubble_s": bubble,
            "step_time_s": modelled(total, "compute + exposed communication + pipeline bubble")}  # fmt: skip


def _communication(shape: RunShape, machine: Machine, compute_s: float) -> Figure:
    plan = shape.plan
    if plan.world_size == 1:
        return modelled(0.0, "one rank: no collectives")
    param_bytes = 2 if shape.precision.startswith("bf16") or plan.bf16_params else 4
    from gaudi3_scale.models.counting import count_parameters

    moved = step_collective_bytes(
        shape.model, plan, shape.batch,
        parameters=count_parameters(shape.model, trainable_only=False), param_bytes=param_bytes,
    )  # fmt: skip
    spans_nodes = shape.nodes > 1
    link = machine.inter_node_bytes_per_s if spans_nodes else machine.intra_node_bytes_per_s
    p2p = pipeline_p2p(
        shape.model, plan, micro_batch_size=shape.batch.micro_batch_size, micro_batches=shape.batch.accumulation,
        context_length=shape.batch.context_length or shape.model.context_length, element_bytes=param_bytes,
        link_bytes_per_s=link, ranks_sharing_link=shape.ranks_per_node if spans_nodes else 1,
    )  # fmt: skip
    if link.value is None:
        why = link.source.split(": ", 1)[-1]  # the link's own "assumption: " is this figure's kind
        return assumed(None, f"{moved.total / 1e9:.3g} GB per rank per step not timed: {why}")
    # Between nodes, a node's network cards are shared by its ranks: each rank's ring traffic gets its share.
    per_rank = link.value / shape.ranks_per_node if spans_nodes else link.value
    dp_s = (moved.data_parallel + moved.replicas) / per_rank
    intra = machine.intra_node_bytes_per_s.value
    tp_s = moved.tensor_parallel / intra if moved.tensor_parallel and intra else 0.0
    if shape.device_kind == "cpu":
        exposed = dp_s + tp_s
    else:
        exposed = max(0.0, dp_s - BACKWARD_SHARE * compute_s) + tp_s
    shared = f", {shape.ranks_per_node} ranks sharing a node's" if spans_nodes else ","
    pipeline = f"; pipeline point-to-point: {p2p.source.split(': ', 1)[1]}" if plan.pipelined else ""
    return modelled(
        exposed + (p2p.value or 0.0),
        f"{moved.total / 1e9:.3g} GB per rank per step at {per_rank / 1e9:.3g} GB/s per rank{shared} "
        f"{link.source}; the data-parallel part overlaps the backward pass{pipeline}",
    )


def _wall(
    train: TrainConfig,
    checkpoint: CheckpointConfig,
    shape: RunShape,
    machine: Machine,
    probe: Probe | None,
    step_s: float,
    start_step: int,
) -> dict[str, Figure]:
    warmup_steps = _warmup_steps(train, start_step)
    same = probe is not None and probe.key == shape.key
    kind = shape.device_kind
    if same and probe is not None:
        startup = measured(probe.startup_s, probe.source())
        per_warmup = probe.warmup_s / max(probe.warmup_steps, 1)
        warmup = measured(per_warmup * warmup_steps, "the probe's warm-up steps")
    else:
        startup = assumed(STARTUP_S[kind], f"startup on {kind} (launch, imports, data, build), not measured")
        extra = COMPILE_S[kind] if shape.plan.compile else 0.0
        warmup = assumed(warmup_steps * step_s * 2 + extra,
                         "warm-up steps at 2× a steady step" + (f" + {extra:g} s compile" if extra else ""))  # fmt: skip
    steps = train.max_steps - start_step
    after = f" (from the resumed step {start_step})" if start_step else ""
    steady = modelled((steps - warmup_steps) * step_s, f"steps after the warm-up{after} × step time")
    validation = _validations(train, shape, machine, probe if same else None, start_step)
    checkpoints = _checkpoints(checkpoint, start_step, train.max_steps, shape, probe if same else None)
    parts = [startup, warmup, steady, validation, checkpoints]
    total = sum(p.value or 0.0 for p in parts)
    return {"startup_s": startup, "warmup_s": warmup, "steady_s": steady, "validation_s": validation,
            "checkpoint_s": checkpoints, "wall_s": modelled(total, "the sum of the parts")}  # fmt: skip


def _warmup_steps(train: TrainConfig, start_step: int) -> int:
    """The first steps of the process that run slower (a resumed process warms up again)."""
    return min(train.resolved_throughput_warmup_steps(), train.max_steps - start_step)


def _count(start_step: int, max_steps: int, every: int) -> int:
    """Pauses in the steps after `start_step` up to `max_steps`, at every multiple of `every`, and always one
    after the last step."""
    if every <= 0:
        return 1
    return max_steps // every - start_step // every + (1 if max_steps % every else 0)


def _validations(
    train: TrainConfig, shape: RunShape, machine: Machine, probe: Probe | None, start_step: int
) -> Figure:
    count = _count(start_step, train.max_steps, train.val_every_steps)
    if probe is not None and probe.validation_s is not None:
        return modelled(count * probe.validation_s, f"{count} pass(es) at the probe's measured rate")
    flops = shape.validation_flops_per_rank(train.val_batches)
    rate = (machine.peak_flops_per_rank.value or 1.0) * (machine.mfu.value or 1.0)
    return modelled(
        count * flops / rate, f"{count} pass(es) of {train.val_batches} micro-batches, forward only"
    )


def _checkpoints(
    ckpt: CheckpointConfig, start_step: int, max_steps: int, shape: RunShape, probe: Probe | None
) -> Figure:
    if not ckpt.enabled:
        return modelled(0.0, "checkpoints off")
    count = _count(start_step, max_steps, ckpt.every_steps)
    if probe is not None and probe.checkpoint_s is not None:
        return measured(count * probe.checkpoint_s, f"{count} × the probe's save")
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
    return assumed(count * seconds, f"{count} save(s) of {size / 1e9:.3g} GB per rank: {how}")


def _energy(machine: Machine, ranks: int, wall_h: float) -> Figure:
    from gaudi3_scale.metering.catalog import DEFAULT_PUE, PUE_SOURCE

    power = machine.power_w_per_rank
    if power.value is None:
        return assumed(None, f"energy unknown: {power.source.split(': ', 1)[-1]}")
    kwh = power.value * ranks * wall_h * DEFAULT_PUE / 1000
    return modelled(kwh, f"ranks × TDP (an upper bound) × wall time × PUE {DEFAULT_PUE:g} ({PUE_SOURCE})")
