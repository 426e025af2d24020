"""A `gaudi3 cost compare` row's layout and step time, from the model `gaudi3 plan` uses (`forecast.model`): one
model, one code path, so the two agree by construction.

The row's run is a `RunShape` (the comparison's strategy, precision, activation checkpointing and micro-batch on the
platform's devices, one micro-batch per data-parallel rank a step); the platform is a forecast `Machine` (this CPU,
or a catalog accelerator, with this machine's calibration store when this machine is one); the step is
`forecast_step`: the FLOPs per rank (the blocks' × 4/3 under activation checkpointing) over peak × MFU, plus the
communication the backward pass does not hide (`forecast.comm` over `forecast/links.yaml`), or the stored probe of
this very layout (`gaudi3 plan --probe`, a tune trial or a benchmark cell on this machine). Training time = tokens ÷
tokens per step × step time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.forecast.figures import Figure, measured
from gaudi3_scale.forecast.machine import Machine, catalog_machine, this_cpu
from gaudi3_scale.forecast.model import forecast_step, stored_probe
from gaudi3_scale.forecast.shape import RunShape

if TYPE_CHECKING:
    from gaudi3_scale.cost.comparison import Assumptions
    from gaudi3_scale.device.specs import AcceleratorSpec
    from gaudi3_scale.models.config import ModelConfig

__all__ = ["comparison_shape", "platform_machine", "platform_step"]


def comparison_shape(
    model: ModelConfig,
    devices: int,
    *,
    per_node: int,
    device_kind: str,
    a: Assumptions,
    layout: tuple[int, int, tuple[int, ...]] = (1, 1, ()),
) -> RunShape:
    """The comparison's run on `devices` accelerators (whole nodes of `per_node` once there are more than one);
    `layout`: (tp_size, pp_size, pp_split) of `tune.layouts.mesh_candidates`. A pipeline runs pp_size micro-batches
    per step, the fewest its 1F1B schedule takes."""
    tp, pp, split = layout
    plan = ParallelPlan.build(
        strategy=a.strategy if devices > 1 else "auto",
        world_size=devices,
        activation_checkpointing=a.activation_checkpointing,
        tp_size=tp,
        pp_size=pp,
        pp_schedule="1f1b",
        pp_split=split,
    )
    # As the trainer builds it (RunConfig.parallel_plan): sharded bf16-mixed parameters are gathered in bf16.
    plan = dataclasses.replace(plan, bf16_params=a.precision == "bf16-mixed" and plan.shards_parameters)
    batch = BatchPlan.from_micro_batch(
        a.micro_batch_size,
        accumulation=pp,
        data_parallel_size=plan.data_parallel_size,
        context_length=model.context_length,
    )
    nodes = math.ceil(devices / per_node)
    return RunShape.build(model, plan, batch, precision=a.precision, device_kind=device_kind, nodes=nodes,
                          ranks_per_node=min(devices, per_node))  # fmt: skip


def platform_machine(
    spec: AcceleratorSpec, a: Assumptions, *, mfu: float | None, benchmarked: dict[str, tuple[float, str]]
) -> tuple[Machine | None, str]:
    """(the platform as the forecast sees it, "") or (None, why its time is unknown). An MFU measured by benchmarks
    (`--from-benchmarks`) or given (`--mfu`) replaces the machine's, and then its stored probes are not used."""
    machine = this_cpu(1) if spec.name == "cpu" else catalog_machine(spec.name, a.precision)
    if spec.name in benchmarked:
        value, where = benchmarked[spec.name]
        return dataclasses.replace(machine, mfu=Figure(value, where), store=None), ""
    if benchmarked:
        return None, "no benchmark result for this accelerator"
    if mfu is not None:
        return dataclasses.replace(machine, mfu=Figure(mfu, "given"), store=None), ""
    return machine, ""


def platform_step(shape: RunShape, machine: Machine) -> tuple[dict[str, Figure], Figure]:
    """(the step's figures as `gaudi3 plan` gives them, the MFU behind them: the machine's, or the probe's achieved ÷
    peak when a stored probe of this layout gave the step)."""
    step = forecast_step(shape, machine)
    probe = stored_probe(shape, machine)
    peak = machine.peak_flops_per_rank.value
    if probe is None or not peak:
        return step, machine.mfu
    return step, measured(probe.achieved_flops_per_rank / peak, probe.source())
