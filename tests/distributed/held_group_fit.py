"""Worker for test_teardown: a multi-rank fit whose callback keeps a process group of its own, which the run cannot
release; each rank must say so in one warning.

    torchrun --nproc-per-node 2 held_group_fit.py [gaudi3 train overrides…]
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist

from gaudi3_scale.train import GaudiTrainer
from gaudi3_scale.train.config import resolve_config


class HoldGroup(pl.Callback):
    def __init__(self) -> None:
        self.group: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.group = dist.new_group(ranks=list(range(trainer.world_size)))


if __name__ == "__main__":
    hold = HoldGroup()
    GaudiTrainer(resolve_config(None, sys.argv[1:]), callbacks=[hold], progress=False).fit()
    assert hold.group is not None
