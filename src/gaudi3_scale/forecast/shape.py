"""What a forecast is of (`RunShape`): the resolved model, the parallel and batch plans, the precision and the
machine's device and geometry; its probe key, and the FLOPs of a step and of a validation pass per rank."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gaudi3_scale.config.core import to_dict
from gaudi3_scale.device.float8 import Float8Plan
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.forecast.calibration import probe_key
from gaudi3_scale.forecast.figures import Figure, modelled
from gaudi3_scale.forecast.pipeline import busiest_rank_share, head_flops_per_token
from gaudi3_scale.models import ModelConfig, flops_per_token

__all__ = ["RECOMPUTE_FACTOR", "RunShape", "fp8_gain_figure"]

# activation checkpointing runs each block's forward (1/3 of its FLOPs) once more; only the blocks are checkpointed
# (distributed.parallelize.apply_activation_checkpointing wraps `find_blocks`), never the output head
RECOMPUTE_FACTOR = 4 / 3


def fp8_gain_figure(model: ModelConfig, float8: Float8Plan) -> Figure:
    """The tokens/s an fp8 run of `model` converted as `float8` says makes over bf16-mixed's (`tune.fp8_gain`: only
    the linears run in fp8, so the FP8 dense peak is no rate a step reaches; its one measured constant is from
    Llama 3.2 1B on an H200): the forecast times an fp8 step as the bf16 one ÷ this."""
    from gaudi3_scale.tune.fp8_gain import fp8_gain

    gain = fp8_gain(model, float8)
    return modelled(
        gain.gain,
        f"fp8 gain ×{gain.gain:.3f} over bf16-mixed (tune.fp8_gain: {float8.recipe}, {gain.share:.0%} of the FLOPs "
        "in linears fp8 speeds up)",
    )


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
            # how fp8 converts the linears (train.fp8_*) decides its step too; only under fp8, as above
            **({"fp8": asdict(plan.float8)} if plan.float8 is not None else {}),
        }

    @property
    def key(self) -> str:
        return probe_key(self.layout())

    def flops_per_step_per_rank(self) -> float:
        """FLOPs of the busiest rank: the step's (its blocks' × `RECOMPUTE_FACTOR` under activation checkpointing,
        the head's once) over the ranks of one pipeline stage, × the share of them the busiest pipeline rank runs (1
        without a pipeline)."""
        fpt = flops_per_token(self.model, self.model.context_length)
        if self.plan.activation_checkpointing:
            head = head_flops_per_token(self.model)
            fpt = head + (fpt - head) * RECOMPUTE_FACTOR
        share = busiest_rank_share(self.model, self.plan, fpt)
        return fpt * self.batch.tokens_per_step * share * self.plan.pp_size / self.plan.world_size

    def fp8_gain(self) -> Figure | None:
        """What fp8 makes over bf16-mixed on this run's model (`fp8_gain_figure`); None: the run is not fp8."""
        float8 = self.plan.float8
        return None if float8 is None else fp8_gain_figure(self.model, float8)

    def validation_batches_per_rank(self, val_batches: int) -> int:
        """The micro-batches of one validation pass a rank runs: the `val_batches` of the val set split over the
        data-parallel ranks as `data.loader._rank_share` splits one dataset's (its budget rounded down to a multiple
        of dp, all of them when there are fewer than dp ranks); a mixture rounded up to one batch per member
        (`data.loader._divisible_batches`) is not modelled."""
        dp_ranks = self.plan.data_parallel_size
        return val_batches // dp_ranks if val_batches >= dp_ranks else val_batches

    def validation_flops_per_rank(self, val_batches: int) -> float:
        """One validation pass on the busiest rank: its micro-batches (`validation_batches_per_rank`), forward only
        (a third of training's FLOPs), the busiest pipeline rank's share of them, over tensor parallel."""
        fpt = flops_per_token(self.model, self.model.context_length)
        tokens = (
            self.validation_batches_per_rank(val_batches)
            * self.batch.micro_batch_size
            * self.model.context_length
        )
        share = busiest_rank_share(self.model, self.plan, fpt)
        return fpt / 3 * tokens * share / self.plan.tp_size
