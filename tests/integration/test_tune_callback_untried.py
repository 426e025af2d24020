"""`GlobalBatchFinder` trains only with a micro-batch its search ran: a real tiny model in `Trainer.fit` where every
batch above a threshold raises the CPU allocator's out-of-memory error (what Lightning's `is_oom_error` catches).

Lightning's binary search stops before running a size that reaches its cap and returns it untried; the finder
once took that size (the per-rank batch) as the micro-batch, and fit then ran out of memory."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gaudi3_scale.tune.callback import GlobalBatchFinder


class OutOfMemoryAbove(pl.LightningModule):
    """Sizes above `limit` fail as the CPU allocator does; `runs` records (phase, size, completed)."""

    def __init__(self, limit: int | None, finder: GlobalBatchFinder) -> None:
        super().__init__()
        self.batch_size = 1
        self.limit, self.finder = limit, finder
        self.layer = torch.nn.Linear(4, 1)
        self.runs: list[tuple[str, int, bool]] = []
        data = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 4, generator=data)
        self.y = self.x.sum(dim=1, keepdim=True)

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        phase = "search" if self.finder.micro_batch_size is None else "fit"
        fits = self.limit is None or len(x) <= self.limit
        self.runs.append((phase, len(x), fits))
        if not fits:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


@pytest.mark.parametrize(
    ("global_batch", "limit", "expected"),
    [
        (8, 4, (4, 2)),  # the hunt's r06: 8 was chosen untried, and fit ran out of memory
        (
            6,
            None,
            (6, 1),
        ),  # the search stops at 4 below its cap of 6 (8 → capped): 6 is then run before it is taken
        (6, 5, (3, 2)),  # 6 is run and does not fit, 4 and 5 fit but divide no batch of 6: 3, run on its own
    ],
)
def test_the_micro_batch_is_the_largest_divisor_that_ran(
    tmp_path: Path, global_batch: int, limit: int | None, expected: tuple[int, int]
) -> None:
    finder = GlobalBatchFinder(global_batch_size=global_batch, steps_per_trial=1)
    model = OutOfMemoryAbove(limit, finder)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, callbacks=[finder], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(model)  # raised out of memory when the finder chose a size it had not run
    assert (finder.micro_batch_size, finder.accumulation) == expected
    ran = {size for phase, size, fits in model.runs if phase == "search" and fits}
    assert finder.micro_batch_size in ran
    assert finder.micro_batch_size == max(d for d in ran if global_batch % d == 0)
    assert finder.largest_that_fits in ran and finder.largest_that_fits >= expected[0]
    assert [size for phase, size, _ in model.runs if phase == "fit"] == [expected[0]] * 2 * expected[1]
