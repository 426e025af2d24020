"""Worker for test_meta_init: for each model, build it on meta, shard it with FSDP2 over every rank
(`distributed.parallelize`), let each rank materialise and initialise only its shards, and have rank 0 save the
gathered full weights and its bytes of parameter storage to OUT_DIR/MODEL.pt. On an even number of ranks, Llama
models are also laid out with tensor parallel over pairs of ranks (FSDP × TP, or TP alone on 2 ranks) and saved to
OUT_DIR/MODEL-tp2.pt.

    torchrun --nproc-per-node N materialize_shards.py SEED OUT_DIR MODEL [MODEL ...]

MODEL is a registry name, optionally with integer overrides: `moe-tiny:num_experts=3` (`model_config`).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from gaudi3_scale.distributed.mesh import build_device_mesh
from gaudi3_scale.distributed.parallelize import build_parallelized
from gaudi3_scale.distributed.plan import ParallelPlan
from gaudi3_scale.distributed.teardown import leave_process_group
from gaudi3_scale.models import ModelConfig, get_model_config
from gaudi3_scale.train.module import next_token_loss


def model_config(spec: str) -> ModelConfig:
    """`name[:field=int,...]`, with the vocabulary resolved to 98 (even: tensor parallel splits its rows)."""
    name, _, overrides = spec.partition(":")
    fields = {k: int(v) for k, v in (item.split("=") for item in overrides.split(",") if item)}
    return replace(get_model_config(name), **fields).resolve_vocab(98)


def main(seed: int, out_dir: str, model_names: list[str]) -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for model_name in model_names:
        _materialize(model_name, seed, f"{out_dir}/{model_name}.pt", world, tp_size=1)
        cfg = model_config(model_name)
        if world % 2 == 0 and cfg.arch == "llama" and not cfg.num_experts:
            _materialize(model_name, seed, f"{out_dir}/{model_name}-tp2.pt", world, tp_size=2)
    rank = dist.get_rank()
    left = leave_process_group()  # the meshes stay in DTensor's caches: their groups are released here
    Path(out_dir, f"gloo-threads-{rank}").write_text(str(left))


def _materialize(model_name: str, seed: int, out: str, world: int, *, tp_size: int) -> None:
    mesh = build_device_mesh("cpu", world_size=world, tp_size=tp_size, dp_replicate=1)
    model = build_parallelized(
        model_config(model_name),
        ParallelPlan(strategy="fsdp", world_size=world, tp_size=tp_size),
        seed=seed,
        loss=next_token_loss,
        mesh=mesh,
        device="cpu",
    ).model
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    full = {name: p.full_tensor() for name, p in model.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save({"weights": full, "local_bytes": local_bytes}, out)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
