"""Keyword arguments of `GaudiTrainer` go to Lightning's Trainer, except those the run config decides: given there,
they overrode the config after the optimizer's schedule and config.yaml were made from it (a `max_steps=4` over a
config of 2 trained steps 3 and 4 at min_lr, and config.yaml said 2)."""

from __future__ import annotations

import pytest

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.train import GaudiTrainer
from gaudi3_scale.train.config import RunConfig


@pytest.mark.parametrize(
    ("key", "field"),
    [("max_steps", "train.max_steps"), ("precision", "train.precision"), ("devices", "parallel.nproc_per_node"),
     ("strategy", "parallel.strategy"), ("accumulate_grad_batches", "train.global_batch_size")],
)  # fmt: skip
def test_an_argument_the_config_decides_is_one_line_naming_its_field(key: str, field: str) -> None:
    with pytest.raises(UserInputError, match=rf"^GaudiTrainer: {key}= is the run config's to set \({field}"):
        GaudiTrainer(RunConfig(), progress=False, **{key: 4})


def test_other_lightning_arguments_reach_the_trainer() -> None:
    trainer = GaudiTrainer(RunConfig(), progress=False, log_every_n_steps=5, enable_model_summary=True)
    assert trainer.trainer_kwargs == {"log_every_n_steps": 5, "enable_model_summary": True}
