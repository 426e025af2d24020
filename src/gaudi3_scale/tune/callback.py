"""A Lightning callback that tunes micro-batch × gradient accumulation before `fit`, at a fixed global batch.

Lightning's `BatchSizeFinder` finds the largest batch that fits and then trains with it, which changes the global
batch (and so the optimization) whenever memory changes. `GlobalBatchFinder` keeps the global batch the user chose:
it runs Lightning's own OOM-safe search (binary search, model and optimizer state restored afterwards) capped at the
per-rank batch, then trains with the largest divisor of the per-rank batch that fits as the micro-batch and the
gradient accumulation that makes up the rest. The learning rate needs no change: the global batch did not change.

Like Lightning's finder it runs in the training process, so it needs a single-device strategy and a
`batch_size` attribute (or `batch_arg_name`) on the module or datamodule. Strategy, precision and several ranks
are searched by `gaudi3 tune`, whose trials are separate processes.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.utilities.parsing import lightning_setattr

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.distributed.plan import BatchPlan
from gaudi3_scale.tune.space import divisors

__all__ = ["GlobalBatchFinder"]


class GlobalBatchFinder(BatchSizeFinder):
    def __init__(
        self,
        global_batch_size: int,
        *,
        steps_per_trial: int = 3,
        max_micro_batch_size: int | None = None,
        batch_arg_name: str = "batch_size",
    ) -> None:
        if global_batch_size < 1:
            raise UserInputError(f"global_batch_size must be at least 1, got {global_batch_size}")
        super().__init__(
            mode="binsearch",
            steps_per_trial=steps_per_trial,
            init_val=1,
            batch_arg_name=batch_arg_name,
            margin=0.0,  # rounding down to a divisor of the per-rank batch is the margin
        )
        self.global_batch_size = global_batch_size
        self.max_micro_batch_size = max_micro_batch_size
        self.micro_batch_size: int | None = None
        self.accumulation: int | None = None
        self.largest_that_fits: int | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str | None = None) -> None:
        super().setup(trainer, pl_module, stage)  # Lightning's checks: a single-device strategy, a batch_size
        per_rank = self._batch(trainer).per_rank_batch_size
        self._max_val = min(per_rank, self.max_micro_batch_size or per_rank)

    def scale_batch_size(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().scale_batch_size(trainer, pl_module)  # Lightning's search; leaves the size it found set
        found = self.optimal_batch_size or 1
        per_rank = self._batch(trainer).per_rank_batch_size
        self.largest_that_fits = found
        fits = max(1, min(found, self._max_val))
        batch = self._batch(trainer, max(d for d in divisors(per_rank) if d <= fits))
        self.micro_batch_size, self.accumulation = batch.micro_batch_size, batch.accumulation
        lightning_setattr(pl_module, self._batch_arg_name, batch.micro_batch_size)
        trainer.accumulate_grad_batches = batch.accumulation
        _reset_train_dataloader(trainer)

    def _batch(self, trainer: pl.Trainer, micro_batch_size: int | None = None) -> BatchPlan:
        """The global batch over the trainer's ranks, all of them data-parallel: tensor parallel (Lightning's
        ModelParallelStrategy) never gets here, since Lightning's finder refuses every distributed strategy."""
        return BatchPlan.build(
            global_batch_size=self.global_batch_size,
            micro_batch_size=micro_batch_size,
            data_parallel_size=trainer.world_size,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "accumulation": self.accumulation}


def _reset_train_dataloader(trainer: pl.Trainer) -> None:
    """Rebuild the training dataloader with the chosen micro-batch (what Lightning's finder does after a trial)."""
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.setup_data()
