"""Worker for test_step_collectives: a multi-rank fit that records, in order, each torch.distributed collective
called from Python (its name and whether it was asynchronous) and where each training batch starts and ends; rank R
writes them to <dir>/collectives-R.json.

    torchrun --nproc-per-node 2 step_collectives_fit.py <dir> [gaudi3 train overrides…]
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist

from gaudi3_scale.train import GaudiTrainer
from gaudi3_scale.train.config import resolve_config

COLLECTIVES = ("broadcast", "all_reduce", "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")  # fmt: skip
events: list[list[Any]] = []


def _recorded(name: str, call: Any) -> Any:
    @functools.wraps(call)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        events.append([name, bool(kwargs.get("async_op"))])
        return call(*args, **kwargs)

    return recorded


class Boundaries(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        events.append(["batch_start", trainer.global_step + 1])

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        events.append(["batch_end", trainer.global_step])


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for name in COLLECTIVES:  # before the run imports them by name: Lightning and the run call dist.<name>
        setattr(dist, name, _recorded(name, getattr(dist, name)))
    GaudiTrainer(resolve_config(None, sys.argv[2:]), callbacks=[Boundaries()], progress=False).fit()
    (out / f"collectives-{os.environ['RANK']}.json").write_text(json.dumps(events))  # the fit left the group
