"""Bytes a rank moves per optimizer step in its collectives, by layout — the communication term of the step-time
model. Ring collectives over n ranks: an all-reduce of B bytes moves 2(n−1)/n·B per rank, an all-gather or a
reduce-scatter (n−1)/n·B (the `busbw` convention of nccl-tests), so time = bytes ÷ the link's bus bandwidth.

- DDP: one all-reduce of the fp32 gradients per optimizer step (micro-steps before it skip the sync).
- FSDP (ZeRO-3): per micro-step, an all-gather of the parameters for forward and again for backward, and a
  reduce-scatter of the gradients; SHARD_GRAD_OP (ZeRO-2-like) gathers once per micro-step; HSDP adds an
  all-reduce of each shard's gradients across the replicas, once per step.
- DeepSpeed ZeRO-2: a reduce-scatter of the gradients after every micro-step's backward (partitioned gradients
  are accumulated sharded: "ZeRO stage >= 2 communicates during non gradient accumulation boundaries as well",
  DeepSpeed's engine, PR #2786; maintainers in deepspeedai/DeepSpeed#2252) and an all-gather of the updated
  parameters per step; ZeRO-3 as FSDP (its parameters gathered for each micro-step's forward and backward).
  ZeRO-2's all-gather follows the optimizer step, with no compute left to hide behind; and with
  `ZERO_OVERLAP_COMM` off (as `distributed.deepspeed` sets it) both stages reduce the gradients on the compute
  stream. That traffic (`serial`) does not overlap backward; ZeRO-3's gathers run on their own stream (prefetched)
  and overlap as FSDP's do.
- Tensor parallel: per layer and micro-step, two all-reduces of the activations in forward and two in backward.
- Pipeline parallel: a rank's collectives are over its stages' parameters and layers (1/pp_size of the model),
  FSDP's once per step (the stages keep parameters gathered and gradients unsharded over the micro-batches);
  the point-to-point traffic between stages is `forecast.pipeline`'s.

Where a group's ranks sit follows the mesh's rank order (`distributed.mesh`: pipeline outermost, then replicas,
shards, tensor parallel innermost; ranks fill nodes in order): the data-parallel (FSDP: shard) group of a replica and
pipeline stage is every tp-th rank of a run of dp_shard × tp consecutive ranks, the replica group every
(dp_shard × tp)-th of dp_replicate × dp_shard × tp. A group whose run of ranks divides a node's ranks stays inside
each node (HSDP's shards, a pipeline stage's data parallel across nodes), so its collectives use the intra-node
link; otherwise some group spans nodes and, the slowest setting the pace, its collectives are timed between nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from gaudi3_scale.distributed.plan import ZERO_OVERLAP_COMM, BatchPlan, ParallelPlan
from gaudi3_scale.models import ModelConfig

__all__ = ["CollectiveBytes", "step_collective_bytes", "within_a_node"]

GRAD_BYTES = 4  # gradients are reduced in fp32 (FSDP's bf16-mixed policy reduces in fp32 too)


@dataclass(frozen=True)
class CollectiveBytes:
    data_parallel: float  # bytes per rank per optimizer step over the data-parallel group
    data_parallel_ranks: int
    tensor_parallel: float  # over the tensor-parallel group (within a node)
    replicas: float = 0.0  # HSDP: across the replicas (spans nodes first)
    data_parallel_span: int = 1  # consecutive ranks one data-parallel group lies in (module docstring)
    replicas_span: int = 1  # consecutive ranks one replica group lies in
    serial: float = 0.0  # of data_parallel: what hides behind no compute (DeepSpeed's; module docstring)

    @property
    def total(self) -> float:
        return self.data_parallel + self.tensor_parallel + self.replicas


def within_a_node(span_ranks: int, ranks_per_node: int) -> bool:
    """Whether every group lying in `span_ranks` consecutive ranks (mesh order) stays inside a node: the runs
    start at multiples of `span_ranks` and nodes at multiples of `ranks_per_node`."""
    return ranks_per_node % span_ranks == 0


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def step_collective_bytes(
    model: ModelConfig, plan: ParallelPlan, batch: BatchPlan, *, parameters: int, param_bytes: int
) -> CollectiveBytes:
    """Bytes per rank per optimizer step; `parameters` = the whole model's, `param_bytes` = a gathered element."""
    tp, accumulation = plan.tp_size, batch.accumulation
    # a tensor-parallel rank holds 1/tp of every split weight (close enough for the rest), a pipeline rank 1/pp of
    # the layers
    local = parameters / (tp * plan.pp_size)
    strategy = plan.strategy
    shard = plan.dp_shard if plan.shards_parameters else plan.data_parallel_size
    dp = 0.0
    replicas = 0.0
    if plan.pipelined and plan.shards_parameters:
        # torch's pipeline stages keep FSDP's gathered parameters and unsharded gradients from the first
        # micro-batch to the last (stage.py: set_reshard_after_backward / set_requires_gradient_sync False until
        # `perform_reduce_grad`): one all-gather and one reduce-scatter per step
        dp = _ring(shard) * local * (param_bytes + GRAD_BYTES)
    elif strategy == "ddp":
        dp = 2 * _ring(plan.data_parallel_size) * local * GRAD_BYTES
    elif strategy in ("fsdp", "deepspeed_zero3"):
        dp = accumulation * _ring(shard) * local * (2 * param_bytes + GRAD_BYTES)
    elif strategy == "fsdp_grad_op":
        dp = accumulation * _ring(shard) * local * (param_bytes + GRAD_BYTES)
    elif strategy == "deepspeed_zero2":
        dp = _ring(shard) * local * (accumulation * GRAD_BYTES + param_bytes)
    serial = 0.0
    if plan.uses_deepspeed:
        gradients = accumulation * _ring(shard) * local * GRAD_BYTES
        after_step = _ring(shard) * local * param_bytes if strategy == "deepspeed_zero2" else 0.0
        serial = after_step + (0.0 if ZERO_OVERLAP_COMM else gradients)
    if plan.shards_parameters and plan.dp_replicate > 1:
        replicas = 2 * _ring(plan.dp_replicate) * local / max(shard, 1) * GRAD_BYTES
    tensor = 0.0
    if tp > 1:
        activation = batch.micro_batch_size * batch.context_length * model.dim * param_bytes
        tensor = accumulation * model.num_layers / plan.pp_size * 4 * 2 * _ring(tp) * activation
    return CollectiveBytes(dp, shard, tensor, replicas, data_parallel_span=shard * tp,
                           replicas_span=plan.dp_replicate * shard * tp, serial=serial)  # fmt: skip
