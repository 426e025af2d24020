"""What a forecast is of (`RunShape`): the resolved model, the parallel and batch plans, the precision and the
machine's device and geometry; its probe key, and the FLOPs of a step and of a validation pass per rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gaudi3_scale.config.core import to_dict
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.forecast.calibration import probe_key
from gaudi3_scale.forecast.pipeline import busiest_rank_share
from gaudi3_scale.models import ModelConfig, flops_per_token

__all__ = ["RECOMPUTE_FACTOR", "RunShape"]

RECOMPUTE_FACTOR = 4 / 3  # activation checkpointing runs each block's forward (1/3 of its FLOPs) once more


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
