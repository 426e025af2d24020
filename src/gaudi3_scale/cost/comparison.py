"""The data of a cost comparison — the assumptions, one row per platform, the whole comparison — with no behaviour
beyond serialising itself: `cost.estimate` computes it, `cost.report` renders it, and neither needs the other's
module to name these types.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from gaudi3_scale.metering.catalog import DEFAULT_PUE, PUE_SOURCE

__all__ = [
    "DEFAULT_MEMORY_FRACTION",
    "DEFAULT_PUE",
    "PUE_SOURCE",
    "Assumptions",
    "ComparisonData",
    "PlatformEstimate",
]

DEFAULT_MEMORY_FRACTION = 0.95  # the tuner's default target: what the runtime and fragmentation leave free


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    precision: str = "bf16-mixed"
    # FSDP2 with ZeRO-3 sharding: what lets the fewest devices hold the model, and the trainer builds it on cuda and
    # on Gaudi (distributed.strategies.STRATEGIES_BY_DEVICE) where DeepSpeed ZeRO-3 is refused.
    strategy: str = "fsdp"
    activation_checkpointing: bool = True
    micro_batch_size: int = 1
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    pue: float = DEFAULT_PUE
    pue_source: str = PUE_SOURCE
    power_fraction_of_tdp: float = 1.0  # average draw ÷ TDP; 1.0 is the upper bound
    usd_per_kwh: float | None = None

    def lines(self) -> list[str]:
        energy_price = (
            f"${self.usd_per_kwh:g}/kWh"
            if self.usd_per_kwh is not None
            else "no electricity price given (energy $ unknown; cloud prices already include power)"
        )
        return [
            "training FLOPs = FLOPs per token × tokens; FLOPs per token = 6·N (N: parameters in matmuls) + "
            "12·L·H·Q·T attention (PaLM, Chowdhery et al. 2022, App. B); the step time counts recomputation",
            "time = tokens ÷ tokens per step × step time, the step as `gaudi3 plan` forecasts it (forecast/model.py): "
            "FLOPs per rank (the blocks' × 4/3 under activation checkpointing) ÷ (peak dense FLOP/s × MFU) + the "
            "communication the backward pass does not hide (forecast/comm.py over forecast/links.yaml); a stored "
            "probe of the layout on this machine replaces both",
            f"fit: {self.strategy} (FSDP2: parameters, gradients and optimizer state sharded as in ZeRO-3; a "
            "strategy the trainer runs on every platform, on Gaudi over HCCL, not yet validated on Gaudi hardware; "
            f"DeepSpeed is not proposed for Gaudi), {self.precision}, activation checkpointing "
            f"{'on' if self.activation_checkpointing else 'off'}, micro-batch {self.micro_batch_size}, within "
            f"{self.memory_fraction:.0%} of device memory (tune.memory estimator); a model that fits on no count so "
            "gets the leanest of its layouts with tensor parallel inside a node × pipeline parallel 2–16 (1F1B, pp "
            "micro-batches a step) where the layers allow (tune.layouts.mesh_candidates); whole nodes are rented",
            "cost = node-hours × instance $/h (cheapest catalog instance with the accelerator); spot as the "
            "catalog's range; unknown prices stay unknown",
            f"energy = accelerators × TDP × {self.power_fraction_of_tdp:g} × hours × PUE {self.pue:g}"
            + (f" ({self.pue_source})" if self.pue == DEFAULT_PUE else "")
            + f"; accelerators only; {energy_price}",
        ]


@dataclass(frozen=True, kw_only=True)
class PlatformEstimate:
    platform: str  # as the user named it
    accelerator: str  # catalog name ("h100-sxm") or "cpu"
    peak_tflops: float
    peak_source: str
    memory_gb: float
    tdp_w: float | None
    fits: bool
    note: str  # why it does not fit, or what is unknown
    min_accelerators: int | None  # fewest devices that hold one training step
    per_node: int
    nodes: int | None
    accelerators: int | None  # what the run uses: nodes × per_node
    memory_per_device_gib: float | None  # estimate at `accelerators`
    mfu: (
        float | None
    )  # behind the step time: the machine's, given, benchmarked, or a stored probe's achieved ÷ peak
    mfu_source: str
    tokens_per_step: int | None  # one micro-batch of the context per data-parallel rank
    step_time_s: float | None  # gaudi3 plan's step time of this layout (forecast.model)
    step_time_source: str | None  # where it comes from (model: compute + communication, or a probe)
    train_hours: float | None
    accelerator_hours: float | None
    instance: str | None  # "aws p5.48xlarge us-east-1"
    price_source: str | None
    on_demand_usd_per_node_hour: float | None
    on_demand_usd: float | None
    spot_usd_low: float | None
    spot_usd_high: float | None
    capacity_block_usd: float | None
    energy_kwh: float | None
    energy_usd: float | None
    usd_per_million_tokens: float | None  # on-demand
    tokens_per_usd: float | None  # on-demand

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class ComparisonData:
    """What `gaudi3 cost compare` found: the model, the training budget, the assumptions, one row per platform."""

    model: str
    parameters: int
    flops_per_token: float
    context_length: int
    tokens: float
    training_flops: float
    assumptions: Assumptions
    rows: list[PlatformEstimate] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "parameters": self.parameters,
            "flops_per_token": self.flops_per_token,
            "context_length": self.context_length,
            "tokens": self.tokens,
            "training_flops": self.training_flops,
            "assumptions": dataclasses.asdict(self.assumptions),
            "assumption_lines": self.assumptions.lines(),
            "rows": [row.to_dict() for row in self.rows],
        }
