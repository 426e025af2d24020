"""Pipeline parallel through `torch.distributed.pipelining` (torchtitan's `pipeline_llm`, written for our model).

The whole model is built on meta; each rank keeps the stages `distributed.stages` gives it, every stage a
`Transformer` pruned to its layers (the first keeps the embeddings, the last the final norm and head; the model
code runs a stage whose embeddings are None on hidden states and returns them when its head is None). Layers keep
their whole-model index as their key, so parameter names, the seeded init (`models.common.init`), `init_from` and
checkpoints are those of the whole model: each stage initialises or reads only its layers. Tensor parallel, float8,
activation checkpointing and FSDP are applied to each stage as `parallelize` applies them to a whole model, then
each is wrapped in a `PipelineStage` and the rank's stages in the schedule `parallel.pp_schedule` names.

A step runs `accumulation` micro-batches through the schedule at once (`Pipeline.train_step`): the schedule's
`scale_grads` divides the summed gradients by the micro-batch count, the same mean a one-process run gets by
dividing each micro-batch loss by the accumulation. FSDP's reduce-scatter of a stage waits for its last micro-batch
(the schedule's `perform_reduce_grad`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gaudi3_scale.distributed.config import STAGES_PER_RANK
from gaudi3_scale.distributed.mesh import PP_DIM
from gaudi3_scale.distributed.stages import local_stages, stage_layers
from gaudi3_scale.distributed.tensor_parallel import local_loss
from gaudi3_scale.models.transformer import Transformer

__all__ = ["Pipeline", "build_stage_modules", "clip_grad_norm_over_stages", "merge_param_groups"]

# parallel.pp_schedule → torch's schedule class name (torch.distributed.pipelining.schedules, torch 2.13)
_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
}

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def build_stage_modules(
    whole: Transformer, *, schedule: str, pp_size: int, pp_rank: int, split: tuple[int, ...] = ()
) -> tuple[Transformer, list[Transformer], list[int]]:
    """(holder, this rank's stage modules, their stage indices) for a model `whole` built on meta.

    The holder is what the LightningModule trains and checkpoints: one `Transformer` registering every module the
    rank holds under its whole-model name (with two stages per rank, both stages' layers). With one stage per rank
    it is the stage itself; with two it shares the stages' modules and is never run.
    """
    num_stages = pp_size * STAGES_PER_RANK[schedule]
    layers = stage_layers(len(whole.layers), num_stages, split)
    indices = local_stages(schedule, pp_size, pp_rank)
    stages = [
        _prune(whole, layers[s], first=s == 0, last=s == num_stages - 1, keep_rope=True) for s in indices
    ]
    if len(stages) == 1:
        return stages[0], stages, indices
    holder = _prune(whole, range(0), first=False, last=False, keep_rope=False)
    for stage in stages:
        for name in ("tok_embeddings", "pos_embeddings", "norm", "output"):
            if getattr(stage, name) is not None:
                setattr(holder, name, getattr(stage, name))
        for key, block in stage.layers.named_children():
            holder.layers.add_module(key, block)
    return holder, stages, indices


def _prune(
    whole: Transformer, layers: Iterable[int], *, first: bool, last: bool, keep_rope: bool
) -> Transformer:
    """A copy of the meta model with only `layers` (under their whole-model keys: a ModuleList iterates its
    modules in order whatever their keys), the embeddings if `first`, the final norm and head if `last`."""
    stage = copy.deepcopy(whole)  # meta: shapes only, nothing is copied
    kept = nn.ModuleList()
    for index in layers:
        kept.add_module(str(index), stage.layers[index])
    stage.layers = kept
    dropped = ([] if first else ["tok_embeddings", "pos_embeddings"]) + ([] if last else ["norm", "output"])
    for name in dropped:
        setattr(stage, name, None)  # the model runs without them (models.transformer.Transformer.forward)
    if not keep_rope:
        stage.rope_cache = None  # the holder never runs: no buffer for Lightning to move off meta
    return stage


@dataclass
class Pipeline:
    """This rank's stages of the pipeline and the schedule that runs them (`parallel.pp_schedule`)."""

    modules: list[Transformer]  # the stage modules, parallelized
    indices: list[int]  # their stage indices
    num_stages: int
    schedule_name: str
    n_microbatches: int  # the train accumulation
    mesh: Any  # the run's device mesh; the pipeline is its PP_DIM dimension
    device: torch.device
    loss: LossFn  # (model, tokens, targets) -> loss, applied to the last stage's logits
    _schedules: dict[bool, Any] = field(default_factory=dict)  # training: n_microbatches; evaluation: 1
    # Applied to each micro-batch loss of the last stage while set: the test-only faults of `health.inject`, set by
    # the training module for the step they belong to.
    loss_hook: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Called before each forward of a stage of this rank while set (the test-only delays of `health.inject`).
    before_forward: Callable[[], None] | None = None
    # Host time of this rank's stage forwards in the last `train_step`: its own compute, without the waits for the
    # other stages that the step's time holds (health.stragglers; `before_forward` counted in).
    forward_s: float = 0.0
    _forward_started: float = 0.0

    def __post_init__(self) -> None:
        for module in self.modules:
            module.register_forward_pre_hook(self._before_stage_forward)
            module.register_forward_hook(self._after_stage_forward)

    def _before_stage_forward(self, module: nn.Module, args: Any) -> None:
        self._forward_started = time.perf_counter()
        if self.before_forward is not None:
            self.before_forward()

    def _after_stage_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.forward_s += time.perf_counter() - self._forward_started

    @property
    def has_first(self) -> bool:
        return 0 in self.indices

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.indices

    def _schedule(self, training: bool) -> Any:
        """The training schedule (`parallel.pp_schedule` over the accumulation's micro-batches), or the
        evaluation one: a validation batch is a single micro-batch, run forward only through the same stages."""
        if training not in self._schedules:
            from torch.distributed import pipelining
            from torch.distributed.pipelining import PipelineStage

            group = self.mesh[PP_DIM].get_group()
            # Stages of their own per schedule: a stage keeps per-schedule buffers (one per micro-batch).
            stages = [
                PipelineStage(module, index, self.num_stages, self.device, group=group)
                for module, index in zip(self.modules, self.indices, strict=True)
            ]
            if training:
                self._schedules[training] = getattr(pipelining, _SCHEDULES[self.schedule_name])(
                    stages if len(stages) > 1 else stages[0],
                    n_microbatches=self.n_microbatches,
                    loss_fn=self._head_loss,
                    scale_grads=True,  # mean over micro-batches, as accumulation divides by it
                )
            else:
                self._schedules[training] = _forward_only(stages, self.schedule_name)
        return self._schedules[training]

    def _head_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`loss` with an identity for the model: the cross-entropy of the logits the last stage returns."""
        loss = local_loss(self.loss(nn.Identity(), logits, targets))
        return loss if self.loss_hook is None else self.loss_hook(loss)

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of a step's micro-batches (concatenated on the batch dimension); the mean of their
        losses, the same on every stage."""
        self.forward_s = 0.0
        return self._run(self._schedule(True).step, tokens, targets)

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of one batch, forward only; the same on every stage."""
        logits = self._schedule(False).step(*((tokens,) if self.has_first else ()))
        return self._share([self._head_loss(logits, targets)] if self.has_last else [])

    def _run(self, run: Callable[..., Any], tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        inputs = (tokens,) if self.has_first else ()
        run(*inputs, target=targets if self.has_last else None, losses=losses if self.has_last else None)
        return self._share(losses)

    def _share(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The last stage's mean micro-batch loss on every rank of the pipeline: a sum in which only the rank
        holding the last stage (the last rank in a loop, the first in a V) adds anything."""
        import torch.distributed as dist

        if losses:
            loss = torch.stack([local_loss(value).detach().float() for value in losses]).mean()
        else:
            loss = torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.mesh[PP_DIM].get_group())
        return loss

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip to the whole model's gradient L2 norm (`clip_grad_norm_over_stages` over this pipeline)."""
        return clip_grad_norm_over_stages(parameters, max_norm, self.mesh[PP_DIM].get_group())


def _forward_only(stages: list[Any], schedule_name: str) -> Any:
    """A schedule that runs one micro-batch forward through the stages, placed as `schedule_name` places them, and
    returns the last stage's output (no loss function: the caller computes it).

    One stage per rank: GPipe. Two: torch's schedule runtime over forward actions alone, each rank running its
    stages in stage order, lowered by torch's own passes (sends and receives added, none between two stages of one
    rank). The ZBV class cannot run forward only (its split backwards are refused in `eval`), and torch 2.13's
    public way to load actions checks for a backward of every micro-batch, hence the lowering called here.
    """
    from torch.distributed.pipelining import ScheduleGPipe
    from torch.distributed.pipelining.schedules import (
        _Action,
        _add_send_recv,
        _add_unshard_reshard,
        _ComputationType,
        _PipelineScheduleRuntime,
    )

    if len(stages) == 1:
        return ScheduleGPipe(stages[0], n_microbatches=1)
    pp_size, num_stages = stages[0].group_size, stages[0].num_stages
    placement = {s: rank for rank in range(pp_size) for s in local_stages(schedule_name, pp_size, rank)}
    schedule = _PipelineScheduleRuntime(stages, n_microbatches=1)
    schedule.stage_index_to_group_rank = placement
    for stage in stages:
        stage.stage_index_to_group_rank = placement
    forward = _ComputationType.FORWARD
    actions = {
        rank: _add_unshard_reshard(
            [_Action(s, forward, 0) for s in sorted(local_stages(schedule_name, pp_size, rank))]
        )
        for rank in range(pp_size)
    }
    schedule.pipeline_order_with_comms = _add_send_recv(
        actions, stage_to_rank=placement.__getitem__, num_stages=num_stages
    )
    return schedule


def clip_grad_norm_over_stages(
    parameters: list[nn.Parameter], max_norm: float, pp_group: Any
) -> torch.Tensor:
    """Clip to the whole model's gradient L2 norm: each rank's norm of its stages' gradients (reduced over the
    tensor- and data-parallel shards by DTensor), squared, summed over the pipeline, as torchtitan's
    `clip_grad_norm_` does."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    squared = norm.float() ** 2
    dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def merge_param_groups(state: dict[str, Any], pp_group: Any) -> dict[str, Any]:
    """A rank's optimizer state dict (DCP's, keyed by parameter name) with each parameter group listing the names
    of every stage's parameters, in the whole model's order: what a one-process optimizer over the whole model
    has. DCP keeps one copy of such a non-tensor entry, so without this a checkpoint would know only one stage's
    groups; with it, a pipeline checkpoint is laid out like any other (each rank loads its own names from the
    superset, `set_optimizer_state_dict`; a whole model numbers them as here, `checkpoint.sharded`)."""
    import torch.distributed as dist

    names = [list(group["params"]) for group in state["param_groups"]]
    gathered: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, names, group=pp_group)
    groups = []
    for index, group in enumerate(state["param_groups"]):
        every = dict.fromkeys(name for rank_names in gathered for name in rank_names[index])
        groups.append({**group, "params": sorted(every, key=_whole_model_position)})
    return {**state, "param_groups": groups}


def _whole_model_position(name: str) -> tuple[int, int]:
    """Where a parameter comes in the whole model: embeddings, then the layers by index, then the final norm and
    head (a stable sort keeps the order within each)."""
    parts = name.split(".")
    if "layers" in parts:
        return 1, int(parts[parts.index("layers") + 1])
    return (0, 0) if any(part.endswith("embeddings") for part in parts) else (2, 0)
