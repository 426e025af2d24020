"""Train with a callback that records every training sample each rank reads (run alone or under torchrun).

    python record_samples.py OUT_JSONL [gaudi3 train overrides…]

Each line of OUT_JSONL.rank<R> is {"step": optimizer steps done before the micro-batch, "samples": [hash, …]},
one hash per sequence of the micro-batch's inputs, so tests can check that no sample is repeated or skipped.
OUT_JSONL.val.rank<R> holds the validation batches the same way.
OUT_JSONL.gloo-threads.rank<R> holds how many gloo worker threads the rank still has after the fit.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from gaudi3_scale.distributed.teardown import gloo_threads
from gaudi3_scale.train import GaudiTrainer
from gaudi3_scale.train.config import resolve_config


class RecordSamples(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any
    ) -> None:
        self._record(Path(f"{self.path}.rank{trainer.global_rank}"), trainer, batch)

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any
    ) -> None:
        self._record(Path(f"{self.path}.val.rank{trainer.global_rank}"), trainer, batch)

    @staticmethod
    def _record(path: Path, trainer: pl.Trainer, batch: Any) -> None:
        hashes = [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16] for row in batch[0].cpu()]
        with path.open("a") as f:
            f.write(json.dumps({"step": trainer.global_step, "samples": hashes}) + "\n")


if __name__ == "__main__":
    out, *overrides = sys.argv[1:]
    config = resolve_config(None, overrides)
    trainer = GaudiTrainer(config, callbacks=[RecordSamples(Path(out))], progress=False)
    trainer.fit()  # kept alive (and the callback): the run must have released its groups all the same
    Path(f"{out}.gloo-threads.rank{os.environ.get('RANK', '0')}").write_text(str(gloo_threads()))
