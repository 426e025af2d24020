"""The forecast of one run: `forecast_run(cfg, machine)` predicts per-rank peak memory (by part), the step time
(compute + exposed communication), tokens/s, the wall time of `train.max_steps` (startup, warm-up, steady steps,
validation and checkpoint pauses), energy and cost (those three: `forecast.wall`) — every number a `Figure` with its
source.

Compute time is the step's FLOPs per rank (PaLM's 6·N + 12·L·H·Q·T per token, the blocks' × 4/3 under activation
checkpointing: their forward runs again in backward) over the rank's achieved FLOP/s: a probe's measurement of this very
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
from gaudi3_scale.forecast.calibration import Probe
from gaudi3_scale.forecast.comm import step_collective_bytes, within_a_node
from gaudi3_scale.forecast.figures import Figure, assumed, measured, modelled, unknown_after
from gaudi3_scale.forecast.machine import Machine, peak_label
from gaudi3_scale.forecast.pipeline import pipeline_bubble, pipeline_p2p
from gaudi3_scale.forecast.shape import RunShape
from gaudi3_scale.forecast.wall import metered_seconds, run_cost, run_energy, wall_time, warmup_steps
from gaudi3_scale.train.train_config import TrainConfig

__all__ = ["Forecast", "forecast_run", "forecast_step", "stored_probe"]

BACKWARD_SHARE = 2 / 3  # the part of compute a data-parallel collective can hide behind


@dataclass
class Forecast:
    run: dict[str, Any]
    memory: dict[str, Figure]
    step: dict[str, Figure]
    tokens_per_s: Figure
    wall: dict[str, Figure]
    energy_kwh: Figure
    cost_usd: Figure  # the bill: nodes × the whole wall time × the price
    # what `cost.budget_usd` is held against and summary.json's cost_usd measures: the live meter's window, from the
    # start of fitting to the last step (train/cost_callback.py), not the startup before it nor the final
    # validation and save after it
    metered_cost_usd: Figure
    sample_memory_bytes: Figure  # the end-of-run text sample (`gaudi3 train --sample-tokens`), host memory
    device_memory_bytes: Figure  # what one rank has: the device's memory, or a CPU's RAM ÷ its ranks
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

    @property
    def fits(self) -> bool | None:
        """Whether a rank's peak memory fits in what the rank has; None: either is unknown."""
        need, have = self.peak_memory_bytes, self.device_memory_bytes.value
        return None if need is None or have is None else need <= have

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
            "predicted_metered_cost_usd": self.metered_cost_usd.value,
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
            "metered_cost_usd": self.metered_cost_usd.as_dict(),
            "sample_memory_bytes": self.sample_memory_bytes.as_dict(),
            "device_memory_bytes": self.device_memory_bytes.as_dict(),
            "fits": self.fits,  # false: it cannot start (out of memory); its time and cost are kept, and said so
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
    tokens = (
        modelled(shape.batch.tokens_per_step / step_time, "tokens per step ÷ step time")
        if step_time is not None
        else unknown_after(step["step_time_s"])
    )
    wall = wall_time(train, checkpoint, shape, machine, probe, step_time, start_step)
    ranks = shape.plan.world_size
    energy = run_energy(machine, ranks, wall["wall_s"])
    price, nodes = price_usd_per_node_hour, shape.nodes
    cost = run_cost(price, nodes, wall["wall_s"], start_step, spent_usd, window="wall time")
    metered = run_cost(price, nodes, metered_seconds(wall, train, checkpoint, start_step), start_step, spent_usd,
                    window="the live meter's time (fit start to the last step; cost.budget_usd counts it)")  # fmt: skip
    run = {
        "name": run_name,
        "model": model.name,
        "start_step": start_step,  # a resumed run's checkpoint step: the wall time is from there to max_steps
        "max_steps": train.max_steps,
        # the steps of wall.warmup_s, after start_step (the dashboard's predicted line)
        "warmup_steps": warmup_steps(train, start_step),
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
    device = _device_memory(machine, shape)
    forecast = Forecast(run, memory, step, tokens, wall, energy, cost, metered, _sample_memory(shape), device)
    if forecast.fits is False:
        forecast.notes.append(
            f"does not fit: {fit_words(forecast)}; the step, wall time, energy and cost are those of a run that "
            "cannot start (it runs out of memory at its first step): shard more (parallel.strategy fsdp, tensor "
            "or pipeline parallel), checkpoint activations, or lower the micro-batch"
        )
    return forecast


def _device_memory(machine: Machine, shape: RunShape) -> Figure:
    """What one rank may use: the device's memory, or on a CPU the RAM its node's ranks share."""
    have = machine.memory_bytes_per_rank
    if machine.ranks_per_node is not None or have.value is None:
        return have
    ranks = shape.ranks_per_node
    return modelled(have.value / ranks, f"{have.source.split(': ', 1)[-1]} ÷ {ranks} rank(s)")


def fit_words(forecast: Forecast) -> str:
    """How a rank's peak memory stands against what it has, in GiB on both sides (a datasheet's GB is 10⁹ bytes,
    so an 80 GB device shows as 74.5 GiB (80 GB)): "29.9 GiB of 74.5 GiB (80 GB) per rank on h100-sxm"."""
    need, have = forecast.peak_memory_bytes, forecast.device_memory_bytes.value
    if need is None or have is None:
        return (
            "unknown: "
            + (forecast.device_memory_bytes if have is None else forecast.memory["total_bytes"]).source
        )
    shown = f"{have / 2**30:,.1f} GiB" + (
        f" ({have / 1e9:,.0f} GB)" if forecast.device_memory_bytes.kind == "catalog" else ""
    )
    relation = "of" if need <= have else ">"
    return f"{need / 2**30:,.1f} GiB {relation} {shown} per rank on {forecast.run['device']}"


def _memory(shape: RunShape, probe: Probe | None) -> dict[str, Figure]:
    from gaudi3_scale.tune.memory import (
        GLIBC_RETAINED_SHARE,
        MMAP_THRESHOLD_ENV,
        allocator_retained_bytes,
        estimate_memory,
        process_peak_bytes,
    )

    estimate = estimate_memory(
        shape.model, shape.plan, shape.batch, precision=shape.precision, device_kind=shape.device_kind
    )
    in_flight = estimate.in_flight_micro_batches
    stage = (
        f"; pipeline rank {estimate.pp_rank} of {estimate.pp_size}, the largest: "
        f"stage{'s' if len(estimate.pp_stages) > 1 else ''} {' and '.join(map(str, estimate.pp_stages))} with "
        f"{in_flight} micro-batch{'es' if in_flight != 1 else ''} in flight"
        if estimate.pp_size > 1
        else ""
    )
    how = f"tune.memory estimator ({estimate.strategy}, peak at {estimate.peak_phase}{stage})"
    parts = {f"{name}_bytes": modelled(float(value), how) for name, value in estimate.rows()}
    if (
        shape.device_kind == "cpu"
    ):  # host memory: what the allocator keeps counts (tune.memory.process_peak_bytes)
        kept = allocator_retained_bytes(estimate)
        parts["allocator_bytes"] = modelled(
            float(kept), f"{MMAP_THRESHOLD_ENV} is set: freed memory goes back at once" if not kept
            else GLIBC_RETAINED_SHARE[1],
        )  # fmt: skip
    total = modelled(float(process_peak_bytes(estimate)), how + " + what the allocator keeps"
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
    if probe is not None and probe.key == shape.key:
        step = measured(probe.step_time_s, f"{probe.source()} ({probe.step_time_s:.4g} s)")
        compute = modelled(step.value, "the probe's step (compute and communication together)")
        return {
            "compute_s": compute,
            "communication_s": modelled(0.0, "inside the probe's step"),
            "bubble_s": modelled(0.0, "inside the probe's step"),
            "step_time_s": step,
        }
    flops = shape.flops_per_step_per_rank()
    peak, mfu = machine.peak_flops_per_rank, machine.mfu
    # unknown: e.g. fp32 on an accelerator whose catalog entry has no FP32 peak (never another precision's)
    if peak.value is None or mfu.value is None:
        unknown = unknown_after(peak if peak.value is None else mfu)
        untimed = assumed(None, "not timed, as compute")
        return {"compute_s": unknown, "communication_s": untimed, "bubble_s": untimed, "step_time_s": unknown}
    rate = peak.value * mfu.value
    how = f"FLOPs per rank ÷ ({peak_label(peak)} × MFU {mfu.value:.3f}: {mfu.source})"
    gain = shape.fp8_gain()  # an fp8 step: the bf16 one ÷ fp8's modelled gain (its peak is the BF16 one)
    if gain is not None and gain.value is not None:
        rate, how = rate * gain.value, f"{how} ÷ {gain.source.split(': ', 1)[-1]}"
    compute = modelled(flops / rate, how)
    comm = _communication(shape, machine, compute.value or 0.0)
    bubble = pipeline_bubble(shape.plan, shape.batch.accumulation, compute.value or 0.0)
    total = (compute.value or 0.0) + (comm.value or 0.0) + (bubble.value or 0.0)
    # Communication that is not timed (a link without a sourced bandwidth: gloo on a CPU, a catalog machine's
    # network) is not 0 s under a model's name: the step leaves it out and says so, an assumption. Not unknown: the
    # compute is timed, and a probe of the layout (or a tune trial, a benchmark cell) measures the whole step.
    step = (
        assumed(
            total, f"compute + pipeline bubble; communication not timed ({comm.source.split(': ', 1)[-1]})"
        )
        if comm.value is None
        else modelled(total, "compute + exposed communication + pipeline bubble")
    )
    return {"compute_s": compute, "communication_s": comm, "bubble_s": bubble, "step_time_s": step}


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
    # each collective group on the link it lives on (forecast.comm: where the mesh puts its ranks); tensor-parallel
    # ranks are neighbours that share a node (tp_size divides a node's ranks)
    parts = [
        (name, moved_bytes, *_group_link(shape, machine, span_ranks))
        for name, moved_bytes, span_ranks in (
            ("data-parallel", moved.data_parallel, moved.data_parallel_span),
            ("replicas", moved.replicas, moved.replicas_span),
            ("tensor-parallel", moved.tensor_parallel, plan.tp_size),
        )
        if moved_bytes
    ]
    links = [on for _, _, on, _ in parts] + ([link] if plan.pipelined else [])
    untimed = next((figure for figure in links if figure.value is None), None)
    if untimed is not None:
        why = untimed.source.split(": ", 1)[-1]  # the link's own "assumption: " is this figure's kind
        return assumed(None, f"{moved.total / 1e9:.3g} GB per rank per step not timed: {why}")
    # Between nodes, a node's network cards are shared by its ranks: each rank's ring traffic gets its share.
    seconds = {name: moved_bytes * sharing / (on.value or 1.0) for name, moved_bytes, on, sharing in parts}
    dp_s = seconds.get("data-parallel", 0.0) + seconds.get("replicas", 0.0)
    # what DeepSpeed runs on the compute stream or after the step (forecast.comm: `serial`) hides behind nothing
    serial_s = seconds["data-parallel"] * moved.serial / moved.data_parallel if moved.serial else 0.0
    tp_s = seconds.get("tensor-parallel", 0.0)
    if shape.device_kind == "cpu":
        exposed = dp_s + tp_s
    else:
        exposed = max(0.0, dp_s - serial_s - BACKWARD_SHARE * compute_s) + serial_s + tp_s
    words = "; ".join(_over_link(*part) for part in parts) or "none"
    serial = f" but for the {moved.serial / 1e9:.3g} GB DeepSpeed does not overlap" if moved.serial else ""
    pipeline = f"; pipeline point-to-point: {p2p.source.split(': ', 1)[1]}" if plan.pipelined else ""
    return modelled(
        exposed + (p2p.value or 0.0),
        f"{moved.total / 1e9:.3g} GB per rank per step: {words}; the data-parallel part overlaps the backward "
        f"pass{serial}{pipeline}",
    )


def _over_link(name: str, moved_bytes: float, link: Figure, sharing: int) -> str:
    shared = f", {sharing} ranks sharing a node's" if sharing > 1 else ","
    rate = (link.value or 0.0) / sharing
    return f"{name} {moved_bytes / 1e9:.3g} GB at {rate / 1e9:.3g} GB/s per rank{shared} {link.source}"


def _group_link(shape: RunShape, machine: Machine, span_ranks: int) -> tuple[Figure, int]:
    """The link a collective group's ring runs over and how many ranks share it: inside a node when the group stays
    in one (`forecast.comm.within_a_node`), else between nodes, a node's network cards shared by its ranks."""
    if within_a_node(span_ranks, shape.ranks_per_node):
        return machine.intra_node_bytes_per_s, 1
    return machine.inter_node_bytes_per_s, shape.ranks_per_node
