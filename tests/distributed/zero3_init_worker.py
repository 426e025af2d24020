"""Worker for test_zero3_init: build each model for a ZeRO-3 plan under DeepSpeed's `zero.Init` (as the strategy
does around configure_model), record how many elements this rank holds, and have rank 0 save the gathered
weights to OUT_DIR/MODEL.pt. A MODEL that is a directory is a pretrained checkpoint (`model.init_from`): its
shape comes from the checkpoint and its weights are loaded module by module, gathered.

    torchrun --nproc-per-node N zero3_init_worker.py SEED OUT_DIR MODEL|CHECKPOINT_DIR [...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gaudi3_scale.distributed.parallelize import build_parallelized
from gaudi3_scale.distributed.plan import ParallelPlan
from gaudi3_scale.distributed.teardown import leave_process_group
from gaudi3_scale.models import get_model_config
from gaudi3_scale.models.pretrained import open_pretrained
from gaudi3_scale.models.pretrained_reader import load_pretrained
from gaudi3_scale.train.module import next_token_loss


def main(seed: int, out_dir: str, model_names: list[str]) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from gaudi3_scale.distributed.deepspeed import skip_inference_comm_build

    skip_inference_comm_build()  # as ZeroStrategy does: no JIT build of an op training never calls
    dist.init_process_group("gloo")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    for name in model_names:
        init_weights, model_cfg = None, None
        if Path(name).is_dir():
            checkpoint = open_pretrained(name)
            model_cfg, name = checkpoint.config, Path(name).name

            def init_weights(model: torch.nn.Module, gathered: Any = None, ckpt: Any = checkpoint) -> None:
                load_pretrained(model, ckpt, seed=seed, gathered=gathered)

        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build_parallelized(
                model_cfg or get_model_config(name).resolve_vocab(97),
                ParallelPlan(strategy="deepspeed_zero3", world_size=dist.get_world_size()),
                seed=seed,
                loss=next_token_loss,
                init_weights=init_weights,
            ).model
        params = list(model.parameters())
        # Outside a gather a partitioned parameter is an empty placeholder; the rank's slice is its ds_tensor.
        held = sum(p.numel() for p in params)
        partition = sum(p.ds_tensor.numel() for p in params)
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if dist.get_rank() == 0:
            torch.save({"weights": full, "held": held, "partition": partition}, f"{out_dir}/{name}.pt")
    rank = dist.get_rank()
    del model, params  # every partitioned parameter holds the group (`ds_process_group`)
    left = leave_process_group()
    Path(out_dir, f"gloo-threads-{rank}").write_text(str(left))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
