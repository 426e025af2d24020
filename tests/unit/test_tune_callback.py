"""`GlobalBatchFinder` inside a plain Lightning `Trainer.fit`: Lightning's own search, then the global batch kept."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.tune.callback import GlobalBatchFinder


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 1
        self.layer = torch.nn.Linear(8, 1)
        self.seen: list[int] = []
        self.optimizer_steps = 0
        data = torch.Generator().manual_seed(0)
        self.x = torch.randn(512, 8, generator=data)
        self.y = self.x.sum(dim=1, keepdim=True)

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        self.seen.append(len(x))
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer_steps += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


def _fit(finder: GlobalBatchFinder, tmp_path: pytest.TempPathFactory | object, max_steps: int) -> Regression:
    model = Regression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model)
    model.trainer_accumulation = trainer.accumulate_grad_batches  # type: ignore[assignment]
    return model


def test_the_whole_per_rank_batch_when_it_fits(tmp_path: object) -> None:
    finder = GlobalBatchFinder(global_batch_size=12, steps_per_trial=1)
    model = _fit(finder, tmp_path, max_steps=3)
    assert (finder.micro_batch_size, finder.accumulation) == (12, 1)
    assert model.batch_size == 12 and model.trainer_accumulation == 1  # type: ignore[attr-defined]
    assert model.seen[-3:] == [12, 12, 12]  # training after the search uses the chosen size


def test_a_capped_micro_batch_keeps_the_global_batch_with_accumulation(tmp_path: object) -> None:
    # The cap stands for what fits (e.g. from `gaudi3 tune --estimate-only`): 5 is not a divisor of 12, so 4.
    finder = GlobalBatchFinder(global_batch_size=12, steps_per_trial=1, max_micro_batch_size=5)
    model = _fit(finder, tmp_path, max_steps=2)
    assert (finder.micro_batch_size, finder.accumulation) == (4, 3)
    assert model.trainer_accumulation == 3  # type: ignore[attr-defined]
    # 2 optimizer steps × 3 micro-batches of 4 after the search: every step saw 12 samples.
    assert model.seen[-6:] == [4] * 6
    assert finder.largest_that_fits is not None and finder.largest_that_fits >= 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"global_batch_size": 0}, "global_batch_size must be at least 1"),
     ({"steps_per_trial": 0}, "steps_per_trial must be at least 1"),  # ran no step: every size would "fit"
     ({"steps_per_trial": -1}, "steps_per_trial must be at least 1"),  # hung
     ({"steps_per_trial": 2.5}, r"steps_per_trial must be at least 1 \(a whole number\), got 2.5"),
     ({"max_micro_batch_size": 0}, "max_micro_batch_size must be at least 1"),  # was read as no cap
     ({"max_micro_batch_size": -3}, "max_micro_batch_size must be at least 1"),  # a bare ValueError at fit
     ({"global_batch_size": True}, "global_batch_size must be at least 1")],
)  # fmt: skip
def test_bad_arguments_are_refused_with_one_line(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(UserInputError, match=message):
        GlobalBatchFinder(**{"global_batch_size": 12, **kwargs})  # type: ignore[arg-type]
