"""Worker for test_zero3_init: build each model for a ZeRO-3 plan under DeepSpeed's `zero.Init` (as the strategy
does around configure_model), record how many elements this rank holds, and have rank 0 save the gathered
weights to OUT_DIR/MODEL.pt.

    torchrun --nproc-per-node N zero3_init_worker.py SEED OUT_DIR MODEL [MODEL ...]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from gaudi3_scale.distributed.parallelize import build_parallelized
from gaudi3_scale.distributed.plan import ParallelPlan
from gaudi3_scale.models import get_model_config
from gaudi3_scale.train.module import next_token_loss


def main(seed: int, out_dir: str, model_names: list[str]) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    dist.init_process_group("gloo")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    for name in model_names:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build_parallelized(
                get_model_config(name).resolve_vocab(97),
                ParallelPlan(strategy="deepspeed_zero3", world_size=dist.get_world_size()),
                seed=seed,
                loss=next_token_loss,
            ).model
        params = list(model.parameters())
        # Outside a gather a partitioned parameter is an empty placeholder; the rank's slice is its ds_tensor.
        held = sum(p.numel() for p in params)
        partition = sum(p.ds_tensor.numel() for p in params)
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if dist.get_rank() == 0:
            torch.save({"weights": full, "held": held, "partition": partition}, f"{out_dir}/{name}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
