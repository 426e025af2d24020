"""The pipeline-parallel terms of the step-time model (`forecast.model`): the compute share of the busiest pipeline
rank, the bubble, and the point-to-point traffic between stages.

* Compute: a rank runs its stages' FLOPs. Blocks split by `distributed.stages.stage_layers` (the trainer's rule);
  the output head's 6·V·h FLOPs per token (part of PaLM's 6·N, `models.counting.flops_per_token`) on the rank
  holding the last stage. The slowest rank sets the pace: every rank waits for it at each micro-batch.
* Bubble: that rank idles `bubble_fraction` of the step (`distributed.schedule_math`, formula cited there), so
  busy time t gives a step of t / (1 − f); bubble_s = t · f / (1 − f).
* Point-to-point: per micro-batch, each stage boundary a rank owns carries the forward activation (b × s × h) one
  way and its gradient back (`p2p_bytes_per_micro_batch`). Over the inter-node link when the run spans nodes (the
  pipeline is the outermost mesh dimension, so neighbouring stages sit on different nodes once a stage's ranks
  fill a node), a node's network cards shared by its ranks. Counted as exposed: a stage's next forward or
  backward waits for the tensor it receives.
"""

from __future__ import annotations

from gaudi3_scale.distributed.config import STAGES_PER_RANK
from gaudi3_scale.distributed.plan import ParallelPlan
from gaudi3_scale.distributed.schedule_math import bubble_fraction, bubble_source, p2p_bytes_per_micro_batch
from gaudi3_scale.distributed.stages import local_stages, stage_layers
from gaudi3_scale.forecast.figures import Figure, assumed, modelled
from gaudi3_scale.models import ModelConfig

__all__ = ["busiest_rank_share", "head_flops_per_token", "pipeline_bubble", "pipeline_p2p"]


def head_flops_per_token(model: ModelConfig) -> float:
    """The output matmul's forward + backward FLOPs per token, 6·V·h: the part of PaLM's 6·N
    (`models.counting.flops_per_token`) outside the transformer blocks."""
    return 6 * model.padded_vocab_size * model.dim


def busiest_rank_share(model: ModelConfig, plan: ParallelPlan, flops_per_token: float) -> float:
    """The share of a step's FLOPs the busiest pipeline rank runs (1/pp_size for an even split, more for the rank
    with the head); 1 without a pipeline."""
    if not plan.pipelined:
        return 1.0
    head = head_flops_per_token(model)
    blocks = flops_per_token - head
    num_stages = plan.pp_size * STAGES_PER_RANK[plan.pp_schedule]
    layers = stage_layers(model.num_layers, num_stages, plan.pp_split)
    shares = []
    for pp_rank in range(plan.pp_size):
        held = local_stages(plan.pp_schedule, plan.pp_size, pp_rank)
        rank_layers = sum(len(layers[s]) for s in held)
        last = num_stages - 1 in held
        shares.append((blocks * rank_layers / model.num_layers + (head if last else 0.0)) / flops_per_token)
    return max(shares)


def pipeline_bubble(plan: ParallelPlan, micro_batches: int, busy_s: float) -> Figure:
    """Seconds of the step the busiest rank idles, from its busy time."""
    if not plan.pipelined:
        return modelled(0.0, "no pipeline")
    fraction = bubble_fraction(plan.pp_schedule, plan.pp_size, micro_batches)
    return modelled(
        busy_s * fraction / (1 - fraction),
        f"{plan.pp_schedule}, p = {plan.pp_size}, m = {micro_batches}: bubble {fraction:.1%} of the step, "
        + bubble_source(plan.pp_schedule),
    )


def pipeline_p2p(
    model: ModelConfig,
    plan: ParallelPlan,
    *,
    micro_batch_size: int,
    micro_batches: int,
    context_length: int,
    element_bytes: int,
    link_bytes_per_s: Figure,
    ranks_sharing_link: int,
) -> Figure:
    """Seconds a pipeline rank spends sending activations and their gradients per step (module docstring)."""
    if not plan.pipelined:
        return modelled(0.0, "no pipeline")
    per_micro = p2p_bytes_per_micro_batch(
        plan.pp_schedule, micro_batch_size, context_length, model.dim, element_bytes, plan.tp_size
    )
    moved = per_micro * micro_batches
    if link_bytes_per_s.value is None:
        return assumed(None, f"{moved / 1e9:.3g} GB per rank per step not timed: {link_bytes_per_s.source}")
    per_rank = link_bytes_per_s.value / ranks_sharing_link
    return modelled(
        moved / per_rank,
        f"{moved / 1e9:.3g} GB per rank per step (activations and their gradients, b × s × h × {element_bytes} "
        f"bytes per micro-batch and stage boundary) at {per_rank / 1e9:.3g} GB/s per rank, {link_bytes_per_s.source}",
    )
