"""A process group the caller initialised before `GaudiTrainer.fit` is the caller's: the fit runs in it and leaves
it up, with the trainer and module (a fit used to destroy it, and the caller's next collective failed with "Default
process group has not been initialized")."""

from __future__ import annotations

import socket
from pathlib import Path

import torch
import torch.distributed as dist

from gaudi3_scale.distributed.teardown import leave_process_group
from gaudi3_scale.train.config import build_run_config
from gaudi3_scale.train.trainer import GaudiTrainer


def test_fit_leaves_the_callers_process_group_up(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    trainer = None
    try:
        overrides = [("out_dir", str(tmp_path / "run")), ("model.name", "llama-tiny"), ("train.max_steps", "2"),
                     ("train.val_every_steps", "0"), ("train.threads", "2")]  # fmt: skip
        trainer = GaudiTrainer(build_run_config(None, overrides), progress=False)
        summary = trainer.fit()
        assert summary["steps"] == 2
        assert dist.is_initialized()
        ones = torch.ones(3)
        dist.all_reduce(ones)  # the caller's collective, after the fit
        assert ones.tolist() == [1.0, 1.0, 1.0]
        assert (
            trainer.trainer is not None and trainer.module is not None
        )  # nothing released with a group not ours
    finally:
        trainer = None  # let go of what holds the group (also after a failed assertion)
        if dist.is_initialized():
            assert (
                leave_process_group() == 0
            )  # this pytest worker lives on: no gloo threads left behind in it
