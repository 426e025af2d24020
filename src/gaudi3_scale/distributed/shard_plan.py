"""Which bytes of a model each rank holds under a `ParallelPlan`, computed from a model built on the meta device:
exact shapes, nothing allocated. `gaudi3 train --dry-run` prints it for any size (llama3-70b on 64 ranks in
seconds on a laptop).

FSDP2 shards every parameter along dim 0 in `torch.chunk` pieces (ceil(rows / ranks) rows each, the last ones
shorter or empty) over the `dp_shard` ranks of one HSDP replica; DeepSpeed ZeRO-3 partitions the flat parameters
evenly; DDP, ZeRO-2 and one process keep them whole. Tied parameters count once.

A mixture of experts' batched expert weights ([experts, in, out], `models/common/moe.GroupedExperts`) have few rows:
Mixtral's 8 experts over 16 ranks would leave half the ranks without expert weights and put a whole expert (a third
of the model) on each of the others. Where the expert count does not divide by the shard ranks they are sharded along
dim 1 instead (`fsdp_shard_dim`, applied by `parallelize.apply_fsdp`; torchtitan shards its experts the same way
when the data-parallel ranks outnumber them).

Tensor parallel (`distributed/tensor_parallel.py`, Megatron's layout) splits each matrix before FSDP shards it:
the row-parallel `wo` and `w2` by columns (dim 1), every other matrix (column-parallel projections, the head, and
the embedding table, row-wise over the vocabulary) by rows; norm weights stay whole. Ranks are laid out
(replicate, shard, tensor parallel), tensor parallel innermost.
"""

from __future__ import annotations

import itertools
import math

from torch import nn

from gaudi3_scale.distributed.plan import ParallelPlan

__all__ = ["fsdp_shard_dim", "largest_rank_elements", "parameter_bytes_per_rank"]


def fsdp_shard_dim(shape: tuple[int, ...], shards: int) -> int:
    """The dimension FSDP2 shards a parameter of `shape` along over `shards` ranks: 0, except for batched expert
    weights (3-D) whose expert count does not divide by the ranks: 1 (module docstring)."""
    return 1 if len(shape) == 3 and shape[0] % shards else 0


_ROW_PARALLEL = ("wo.weight", "w2.weight")  # split by columns under tensor parallel


def _tp_local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, int]:
    """(rows, elements per row) of one tensor-parallel rank's piece of a parameter."""
    rows, row = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
    if tp == 1 or len(shape) != 2:
        return rows, row
    return (rows, row // tp) if name.endswith(_ROW_PARALLEL) else (rows // tp, row)


def parameter_bytes_per_rank(model: nn.Module, plan: ParallelPlan, *, element_bytes: int) -> list[int]:
    """Bytes of parameters each rank stores (rank 0 first), at `element_bytes` per element."""
    ranks = plan.world_size
    params = list(model.named_parameters())  # tied parameters appear once
    if plan.shards_parameters:
        shards = plan.dp_shard
        # Per shard index, as a difference array: torch.chunk gives shards 0..k-1 `size` rows each, shard k the
        # rest, the others none; the work is per parameter and per shard, never per parameter and rank.
        change = [0] * (shards + 1)
        for name, p in params:
            shape = tuple(p.shape)
            if fsdp_shard_dim(shape, shards) == 1:  # [experts, in, out] chunked along `in`
                rows, row = shape[1], shape[0] * shape[2]
            else:
                rows, row = _tp_local_shape(name, shape, plan.tp_size)
            size = math.ceil(rows / shards)
            if not size:
                continue
            full, rest = divmod(rows, size)
            change[0] += size * row * element_bytes
            change[full] -= size * row * element_bytes
            if rest:
                change[full] += rest * row * element_bytes
                change[full + 1] -= rest * row * element_bytes
        by_shard = list(itertools.accumulate(change[:shards]))
        return [by_shard[(rank // plan.tp_size) % shards] for rank in range(ranks)]
    total = sum(p.numel() for _, p in params)
    if plan.partitions_parameters:
        return [math.ceil(total / ranks) * element_bytes] * ranks
    return [total * element_bytes] * ranks


def largest_rank_elements(model: nn.Module, plan: ParallelPlan) -> int:
    """Parameter elements on the rank that holds the most: what must fit (`tune.memory` sizes shards by it)."""
    return max(parameter_bytes_per_rank(model, plan, element_bytes=1))
