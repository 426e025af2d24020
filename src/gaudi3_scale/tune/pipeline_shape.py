"""One pipeline rank's share of a step, for the memory estimator (`tune.memory`): the parameters of the stages it
holds, the activations of the micro-batches its schedule keeps in flight, and the buffers torch's stages allocate.

Stages are split by `distributed.stages.stage_layers` (the trainer's own rule: the first stage also holds the
embeddings, the last the final norm and head) and placed on ranks by `distributed.stages.local_stages`; the
micro-batches in flight are `distributed.schedule_math.in_flight_micro_batches`. On top of the blocks' saved
tensors (`tune.activations`), a stage of torch 2.13's `PipelineStage` holds, per micro-batch of the step:
* receive buffers for its input activations (not on the first stage) and for its output's gradients (not on
  the last), b × s × h each, allocated for every micro-batch when the schedule first runs
  (`_prepare_forward_infra` / `_prepare_backward_infra`: one `_RecvInfo` buffer per chunk) and kept;
* on the last stage, each micro-batch in flight keeps its logits (the stage's output, in `fwd_cache` until its
  backward) and cross-entropy's log-softmax output (the loss runs in the forward step); the one in backward
  is the loss workspace (`tune.activations.loss_workspace_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gaudi3_scale.distributed.config import STAGES_PER_RANK
from gaudi3_scale.distributed.plan import ParallelPlan
from gaudi3_scale.distributed.schedule_math import in_flight_micro_batches
from gaudi3_scale.distributed.stages import local_stages, stage_layers
from gaudi3_scale.tune.activations import ElementBytes, ModelShape, activation_bytes

__all__ = ["RankStages", "pipeline_activation_bytes", "rank_stages", "stage_shape"]


@dataclass(frozen=True)
class RankStages:
    """What pipeline rank `pp_rank` holds: its stages' parameters together (`shape`), each stage with its
    micro-batches in flight at the peak, and whether gradients are alive beside those activations (every
    schedule but GPipe runs further forwards after its first backward)."""

    pp_rank: int
    shape: ModelShape
    stages: tuple[tuple[ModelShape, int], ...]
    micro_batches: int
    grads_in_flight: bool


def stage_shape(sh: ModelShape, layers: int, *, first: bool, last: bool) -> ModelShape:
    """The parameters of a stage of `layers` blocks: embeddings if `first`, final norm and head if `last`."""
    root = (sh.embedding if first else 0.0) + (sh.root - sh.embedding if last else 0.0)
    return replace(
        sh,
        params=root + layers * sh.block,
        root=root,
        head=sh.head if last else 0.0,
        embedding=sh.embedding if first else 0.0,
        layers=layers,
        first=first,
        last=last,
    )


def rank_stages(sh: ModelShape, plan: ParallelPlan, micro_batches: int) -> list[RankStages]:
    """Every pipeline rank's stages (in pipeline order) for a model of shape `sh` (one tensor-parallel rank's
    share) under `plan`; `micro_batches`: the step's (the train accumulation). A split that does not fit is the
    `ConfigError` of `distributed.stages`."""
    num_stages = plan.pp_size * STAGES_PER_RANK[plan.pp_schedule]
    layers = stage_layers(sh.layers, num_stages, plan.pp_split)
    shapes = [
        stage_shape(sh, len(span), first=index == 0, last=index == num_stages - 1)
        for index, span in enumerate(layers)
    ]
    ranks = []
    for pp_rank in range(plan.pp_size):
        counts = in_flight_micro_batches(plan.pp_schedule, plan.pp_size, pp_rank, micro_batches)
        held = [shapes[index] for index in local_stages(plan.pp_schedule, plan.pp_size, pp_rank)]
        combined = replace(
            held[0],
            params=sum(s.params for s in held),
            root=sum(s.root for s in held),
            head=sum(s.head for s in held),
            embedding=sum(s.embedding for s in held),
            layers=sum(s.layers for s in held),
            first=any(s.first for s in held),
            last=any(s.last for s in held),
        )
        stages = tuple((shapes[index], counts[index]) for index in counts)
        forwards = STAGES_PER_RANK[plan.pp_schedule] * micro_batches
        grads = plan.pp_schedule != "gpipe" and sum(counts.values()) < forwards
        ranks.append(RankStages(pp_rank, combined, stages, micro_batches, grads))
    return ranks


def pipeline_activation_bytes(
    rank: RankStages,
    b: int,
    s: int,
    e: ElementBytes,
    ckpt: bool,
    device_kind: str,
    tp: int = 1,
    *,
    compiled: bool = False,
    fp8_inputs: bool = False,
) -> float:
    """What the rank holds for backward at its peak: each stage's saved tensors × its micro-batches in flight (under
    activation checkpointing the one block recomputed in backward counted once), the last stage's logits and
    log-softmax of the micro-batches in flight, and the stages' receive buffers (module docstring)."""
    total = recompute = 0.0
    sbh = s * b * rank.shape.dim
    for stage, count in rank.stages:
        saved = activation_bytes(
            stage, b, s, e, ckpt, device_kind, tp, compiled=compiled, fp8_inputs=fp8_inputs
        )
        if ckpt:
            block = replace(stage, layers=1, first=False, last=False)
            layer = activation_bytes(
                block, b, s, e, False, device_kind, tp, compiled=compiled, fp8_inputs=fp8_inputs
            )
            saved, recompute = saved - layer, max(recompute, layer)
        total += count * saved
        if stage.last and count:
            logits = b * s * stage.vocab / tp
            total += count * logits * e.compute + (count - 1) * logits * e.loss
        buffers = (0 if stage.first else 1) + (0 if stage.last else 1)
        total += buffers * rank.micro_batches * sbh * e.residual / tp
    return total + recompute
