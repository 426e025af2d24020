"""`MemoryOptimizer`: activation checkpointing, HPU graphs and the micro-batch split for any training loop.

    optimizer = MemoryOptimizer(enable_gradient_checkpointing=True, micro_batch_size=8, accumulation_steps=4)
    model = optimizer.optimize_model(model)          # every transformer block recomputed in backward
    for batch in loader:                             # batches of 32 = 8 × 4
        loss = optimizer.accumulate(model, batch, loss_fn)   # 4 forward/backward passes, gradients summed
        opt.step(); opt.zero_grad()

With Lightning, give the DataLoader `micro_batch_size` and the Trainer `**optimizer.trainer_kwargs()`
(`accumulate_grad_batches`). `gaudi3 train` does the same from the config (`parallel.activation_checkpointing`,
`train.micro_batch_size`, `train.hpu_graphs`). What activation checkpointing saves is measured by
`benchmarks/bench_activation_checkpointing.py`. HPU graphs are Gaudi-only and not yet validated on Gaudi hardware.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.distributed.parallelize import apply_single_device
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan

__all__ = ["MemoryOptimizer"]


class MemoryOptimizer:
    """Memory-saving changes to a model and the gradient-accumulation split of each batch.

    `enable_gradient_checkpointing`: recompute each transformer block (the model's `layers`, or its largest list of
    repeated blocks) in backward instead of keeping its activations — less memory, about one more forward of
    compute. `enable_hpu_graphs`: record and replay the model as HPU graphs (Habana's ModuleCacher; Gaudi only,
    lazy mode). `micro_batch_size` × `accumulation_steps` is the batch one optimizer step sees; without
    `micro_batch_size` each batch is split into `accumulation_steps` equal parts.
    """

    def __init__(
        self,
        enable_hpu_graphs: bool = False,
        enable_gradient_checkpointing: bool = True,
        micro_batch_size: int | None = None,
        accumulation_steps: int = 1,
        *,
        max_hpu_graphs: int = 10,
    ) -> None:
        # 2.5 or "4" would pass a bare `< 1` test (or fail it with a TypeError) and break the split later.
        if micro_batch_size is not None and not _is_count(micro_batch_size):
            raise UserInputError(
                f"MemoryOptimizer: micro_batch_size must be an integer >= 1 or None, got {brief(micro_batch_size)}"
            )
        if not _is_count(accumulation_steps):
            raise UserInputError(
                f"MemoryOptimizer: accumulation_steps must be an integer >= 1, got {brief(accumulation_steps)}"
            )
        self.enable_hpu_graphs = enable_hpu_graphs
        self.enable_gradient_checkpointing = enable_gradient_checkpointing
        self.micro_batch_size = None if micro_batch_size is None else int(micro_batch_size)
        self.accumulation_steps = int(accumulation_steps)
        self.max_hpu_graphs = max_hpu_graphs
        self.checkpointed_blocks = 0

    @property
    def batch_size(self) -> int | None:
        """Samples per optimizer step (micro-batch × accumulation), when the micro-batch is set."""
        if self.micro_batch_size is None:
            return None
        return BatchPlan.from_micro_batch(
            self.micro_batch_size, accumulation=self.accumulation_steps
        ).global_batch_size

    def optimize_model(self, model: nn.Module) -> nn.Module:
        """Apply the enabled changes to `model` in place and return it (parameter names are unchanged): the same
        function, in the same order, as `gaudi3 train` (`distributed.parallelize.apply_single_device`)."""
        plan = ParallelPlan(
            activation_checkpointing=self.enable_gradient_checkpointing, hpu_graphs=self.enable_hpu_graphs
        )
        blocks = apply_single_device(model, plan, max_hpu_graphs=self.max_hpu_graphs)
        if self.enable_gradient_checkpointing:
            self.checkpointed_blocks = blocks
        return model

    def trainer_kwargs(self) -> dict[str, Any]:
        """What a Lightning Trainer needs for this split."""
        return {"accumulate_grad_batches": self.accumulation_steps}

    def micro_batches(self, batch: Any) -> list[Any]:
        """`batch` (a tensor, or a tuple/list/dict of tensors sharing dim 0) cut into `accumulation_steps` parts."""
        size = _batch_len(batch)
        expected = self.batch_size or size
        if size != expected or size % self.accumulation_steps:
            raise ValueError(
                f"MemoryOptimizer: a batch of {size} samples does not split into {self.accumulation_steps} "
                f"micro-batches of {self.micro_batch_size or 'equal size'}; pass batches of "
                f"{self.batch_size or f'a multiple of {self.accumulation_steps}'}"
            )
        part = size // self.accumulation_steps
        return [_slice(batch, start, start + part) for start in range(0, size, part)]

    def accumulate(
        self, model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    ) -> torch.Tensor:
        """Forward and backward over each micro-batch of `batch`, gradients summed as for the whole batch (each loss
        scaled by 1 / accumulation_steps); returns the mean loss, detached. The optimizer step is the caller's."""
        total = torch.zeros(())
        for micro in self.micro_batches(batch):
            loss = loss_fn(model, micro)
            (loss / self.accumulation_steps).backward()
            total = total + loss.detach().float().cpu()
        return total / self.accumulation_steps


def _is_count(value: Any) -> bool:
    """An integer >= 1 (numpy's integers too); a bool, a float such as 2.0 or a str is not one."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 1


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    items = list(batch.values()) if isinstance(batch, Mapping) else batch
    # A str is a Sequence whose items are strs: not a batch (and, unchecked, a recursion without end).
    if isinstance(items, Sequence) and not isinstance(items, (str, bytes)) and items:
        sizes = {_batch_len(item) for item in items}
        if len(sizes) == 1:
            return sizes.pop()
        raise ValueError(
            f"MemoryOptimizer: the batch's tensors disagree on their first dimension: {sorted(sizes)}"
        )
    raise TypeError(
        f"MemoryOptimizer: a batch must be a tensor or a tuple/list/dict of tensors, got {type(batch).__name__}"
    )


def _slice(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return {key: _slice(value, start, stop) for key, value in batch.items()}
    parts = [_slice(item, start, stop) for item in batch]
    # A namedtuple takes its fields by position.
    return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
