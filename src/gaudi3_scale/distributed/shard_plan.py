"""Which bytes of a model each rank holds under a `ParallelPlan`, computed from a model built on the meta device:
exact shapes, nothing allocated. `gaudi3 train --dry-run` prints it for any size (llama3-70b on 64 ranks in
seconds on a laptop).

FSDP2 shards every parameter along dim 0 in `torch.chunk` pieces (ceil(rows / ranks) rows each, the last ones
shorter or empty) over the `dp_shard` ranks of one HSDP replica; DeepSpeed ZeRO-3 partitions the flat parameters
evenly; DDP, ZeRO-2 and one process keep them whole. Tied parameters count once.

Tensor parallel (`distributed/tensor_parallel.py`, Megatron's layout) splits each matrix before FSDP shards it:
the row-parallel `wo` and `w2` by columns (dim 1), every other matrix (column-parallel projections, the head, and
the embedding table, row-wise over the vocabulary) by rows; norm weights stay whole. Ranks are laid out
(replicate, shard, tensor parallel), tensor parallel innermost.
"""

from __future__ import annotations

import math

from torch import nn

from gaudi3_scale.distributed.plan import ParallelPlan

__all__ = ["parameter_bytes_per_rank"]


def _dim0_chunk_rows(rows: int, ranks: int, rank: int) -> int:
    size = math.ceil(rows / ranks)
    return max(0, min(rows, (rank + 1) * size) - rank * size)


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
        per_rank = [0] * ranks
        shards = plan.dp_shard
        for name, p in params:
            rows, row = _tp_local_shape(name, tuple(p.shape), plan.tp_size)
            for rank in range(ranks):
                shard = (rank // plan.tp_size) % shards
                per_rank[rank] += _dim0_chunk_rows(rows, shards, shard) * row * element_bytes
        return per_rank
    total = sum(p.numel() for _, p in params)
    if plan.strategy == "deepspeed_zero3":
        return [math.ceil(total / ranks) * element_bytes] * ranks
    return [total * element_bytes] * ranks
