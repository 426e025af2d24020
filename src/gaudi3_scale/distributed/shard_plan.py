"""Which bytes of a model each rank holds under a `ParallelPlan`, computed from a model built on the meta device:
exact shapes, nothing allocated. `gaudi3 train --dry-run` prints it for any size (llama3-70b on 64 ranks in
seconds on a laptop).

FSDP2 shards every parameter along dim 0 in `torch.chunk` pieces (ceil(rows / ranks) rows each, the last ones
shorter or empty); DeepSpeed ZeRO-3 partitions the flat parameters evenly; DDP, ZeRO-2 and one process keep them
whole. Tied parameters count once.
"""

from __future__ import annotations

import math

from torch import nn

from gaudi3_scale.distributed.plan import ParallelPlan

__all__ = ["parameter_bytes_per_rank"]


def _dim0_chunk_rows(rows: int, ranks: int, rank: int) -> int:
    size = math.ceil(rows / ranks)
    return max(0, min(rows, (rank + 1) * size) - rank * size)


def parameter_bytes_per_rank(model: nn.Module, plan: ParallelPlan, *, element_bytes: int) -> list[int]:
    """Bytes of parameters each rank stores (rank 0 first), at `element_bytes` per element."""
    ranks = plan.world_size
    params = list(model.parameters())  # tied parameters appear once
    if plan.shards_parameters:
        per_rank = [0] * ranks
        for p in params:
            row = p.numel() // p.shape[0] if p.ndim else 1
            rows = p.shape[0] if p.ndim else 1
            for rank in range(ranks):
                per_rank[rank] += _dim0_chunk_rows(rows, ranks, rank) * row * element_bytes
        return per_rank
    total = sum(p.numel() for p in params)
    if plan.strategy == "deepspeed_zero3":
        return [math.ceil(total / ranks) * element_bytes] * ranks
    return [total * element_bytes] * ranks
