"""A Lightning callback that tunes micro-batch × gradient accumulation before `fit`, at a fixed global batch.

Lightning's `BatchSizeFinder` finds the largest batch that fits and then trains with it, which changes the global
batch (and so the optimization) whenever memory changes. `GlobalBatchFinder` keeps the global batch the user chose:
it runs Lightning's own OOM-safe search (binary search, model and optimizer state restored afterwards) capped at the
per-rank batch, then trains with the largest divisor of the per-rank batch that ran in that search as the
micro-batch and the gradient accumulation that makes up the rest. The learning rate needs no change: the global
batch did not change.

Lightning's binary search stops *before* running a size that reaches its `max_val` and returns that size untried
(lightning 2.6 `tuner.batch_size_scaling._run_binsearch_scaling`), and a size it found need not divide the per-rank
batch. So the search is capped one above the per-rank batch (or `max_micro_batch_size`), and a divisor the search
did not return as run is run by one more search started at it (capped just above it, one trial): it is taken only
if that search returns it, else the search goes on below.

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


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class GlobalBatchFinder(BatchSizeFinder):
    def __init__(
        self,
        global_batch_size: int,
        *,
        steps_per_trial: int = 3,
        max_micro_batch_size: int | None = None,
        batch_arg_name: str = "batch_size",
    ) -> None:
        for name, value in (("global_batch_size", global_batch_size), ("steps_per_trial", steps_per_trial)):
            if not _whole(value):
                raise UserInputError(f"{name} must be at least 1 (a whole number), got {value!r}")
        if max_micro_batch_size is not None and not _whole(max_micro_batch_size):
            raise UserInputError(
                f"max_micro_batch_size must be at least 1 (a whole number), or None for no cap, got "
                f"{max_micro_batch_size!r}"
            )
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
        self.largest_that_fits: int | None = None  # the largest size the searches returned as run
        self._cap = 0  # the largest micro-batch to try (setup)
        self._trials = self._max_trials

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str | None = None) -> None:
        super().setup(trainer, pl_module, stage)  # Lightning's checks: a single-device strategy, a batch_size
        per_rank = self._batch(trainer).per_rank_batch_size
        cap = self.max_micro_batch_size
        self._cap = per_rank if cap is None else min(per_rank, cap)

    def scale_batch_size(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        per_rank, cap = self._batch(trainer).per_rank_batch_size, self._cap
        found = self._search(trainer, pl_module, init_val=1, max_val=cap + 1, max_trials=self._trials)
        while True:
            # What the search returns ran, unless it stopped at its cap untried (found > cap), or even 1 did not
            # fit (found 1: fit then runs out of memory at 1, which is the honest answer).
            ran = found if found is not None and found <= cap else None
            if ran is not None:
                self.largest_that_fits = max(ran, self.largest_that_fits or 0)
            micro = max(d for d in divisors(per_rank) if d <= min(found or 1, cap))
            if found is None or micro == ran:
                break
            # Run `micro` itself: one trial of it or, when it does not fit, Lightning's search below it.
            found = self._search(trainer, pl_module, init_val=micro, max_val=micro + 1, max_trials=1)
            cap = micro if found == micro else micro - 1
        batch = self._batch(trainer, micro)
        self.micro_batch_size, self.accumulation = batch.micro_batch_size, batch.accumulation
        lightning_setattr(pl_module, self._batch_arg_name, batch.micro_batch_size)
        trainer.accumulate_grad_batches = batch.accumulation
        _reset_train_dataloader(trainer)

    def _search(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        *,
        init_val: int,
        max_val: int,
        max_trials: int,
    ) -> int | None:
        """Lightning's search from `init_val`, never running `max_val` or above; the size it returns (None when it
        was skipped, as under fast_dev_run)."""
        self._init_val, self._max_val, self._max_trials = init_val, max_val, max_trials
        # Lightning sets `init_val` on the module but reuses the loader it has (built with the size the previous
        # search left): rebuild it, or the first trial runs that size instead.
        lightning_setattr(pl_module, self._batch_arg_name, init_val)
        _reset_train_dataloader(trainer)
        super().scale_batch_size(trainer, pl_module)  # leaves the size it found set on the module
        return self.optimal_batch_size

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
