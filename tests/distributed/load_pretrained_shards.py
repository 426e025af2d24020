"""Worker for test_init_from_sharded: each checkpoint loaded (`models.pretrained.load_pretrained`) into two layouts
over every rank — FSDP2 (`distributed.parallelize`, Shard(0)) and tensor parallel laid out here with torch's
ColwiseParallel / RowwiseParallel (Shard(0) and Shard(1), vocabulary rows split unevenly), plus, for untied
models, block weights in FSDP-over-TP's _StridedShard(0) (interleaved rows; weights only) — each rank reading only
its blocks — and, for Llama, the trainer's own tensor parallel (TP=2); a Mixtral in FSDP2 only. Rank 0 saves, per checkpoint, both layouts' logits on fixed tokens, their gathered weights and the
placements seen to OUT_DIR/NAME.pt.

    torchrun --nproc-per-node 2 load_pretrained_shards.py OUT_DIR CHECKPOINT_DIR [CHECKPOINT_DIR ...]
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from gaudi3_scale.distributed.mesh import TP_DIM, build_device_mesh
from gaudi3_scale.distributed.parallelize import build_parallelized
from gaudi3_scale.distributed.plan import ParallelPlan
from gaudi3_scale.distributed.teardown import leave_process_group
from gaudi3_scale.models import build_model
from gaudi3_scale.models.pretrained import PretrainedCheckpoint, open_pretrained
from gaudi3_scale.models.pretrained_reader import load_pretrained
from gaudi3_scale.train.module import next_token_loss

TOKENS = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))


def main(out_dir: str, directories: list[str]) -> None:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    fsdp_mesh = build_device_mesh("cpu", world_size=world, tp_size=1, dp_replicate=1)
    run_tp_mesh = build_device_mesh("cpu", world_size=world, tp_size=world, dp_replicate=1)
    tp_mesh = run_tp_mesh[TP_DIM]  # 1-D over every rank; its group is released with the run mesh's
    for directory in directories:  # in a function: its models, which hold groups, go before the leave
        _load_layouts(out_dir, directory, world, fsdp_mesh, run_tp_mesh, tp_mesh)
    left = leave_process_group()  # the groups go with their gloo threads before the exit
    Path(out_dir, f"gloo-threads-{rank}").write_text(str(left))


def _load_layouts(
    out_dir: str,
    directory: str,
    world: int,
    fsdp_mesh: DeviceMesh,
    run_tp_mesh: DeviceMesh,
    tp_mesh: DeviceMesh,
) -> None:
    checkpoint = open_pretrained(directory)

    def fill(model: nn.Module, checkpoint: PretrainedCheckpoint = checkpoint) -> None:
        load_pretrained(model, checkpoint)

    fsdp = build_parallelized(
        checkpoint.config,
        ParallelPlan(strategy="fsdp", world_size=world),
        seed=0,
        loss=next_token_loss,
        mesh=fsdp_mesh,
        device="cpu",
        init_weights=fill,
    ).model
    result = {"fsdp": _observe(fsdp)}
    # Mixtral: experts split over the ranks (Shard(0)); no tensor parallel
    if checkpoint.config.num_experts:
        if dist.get_rank() == 0:
            torch.save(result, f"{out_dir}/{Path(directory).name}.pt")
        return
    result["tp"] = _observe(_tensor_parallel(checkpoint, tp_mesh))
    if checkpoint.config.arch == "llama":
        # the trainer's own tensor parallel (distributed.tensor_parallel: sequence-parallel norms, vocabulary-
        # sharded logits), the vocabulary padded to split over the ranks as the trainer pads it
        cfg = replace(checkpoint.config, pad_vocab_to_multiple=world)
        applied = build_parallelized(
            cfg,
            ParallelPlan(strategy="fsdp", world_size=world, tp_size=world),
            seed=0,
            loss=next_token_loss,
            mesh=run_tp_mesh,
            device="cpu",
            init_weights=fill,
        )
        observed = _observe(applied.model)
        observed["logits"] = observed["logits"][..., : checkpoint.config.vocab_size]
        result["run_tp"] = observed
    if not checkpoint.config.tie_embeddings:
        result["strided"] = _observe(_strided(checkpoint, tp_mesh), forward=False)
    if dist.get_rank() == 0:
        torch.save(result, f"{out_dir}/{Path(directory).name}.pt")


def _tensor_parallel(checkpoint: PretrainedCheckpoint, mesh: DeviceMesh) -> nn.Module:
    """Megatron-style tensor parallel on a meta model, then materialised and filled by the loader."""
    cfg = checkpoint.config
    with torch.device("meta"):
        model = build_model(cfg)
    plan: dict[str, Any] = {}
    for i in range(cfg.num_layers):
        plan |= {f"layers.{i}.attention.{name}": ColwiseParallel() for name in ("wq", "wk", "wv")}
        plan[f"layers.{i}.attention.wo"] = RowwiseParallel()
        plan |= {
            f"layers.{i}.feed_forward.{name}": ColwiseParallel()
            for name in ("w1", "w3")
            if cfg.arch == "llama"
        }
        if cfg.arch == "gpt2":
            plan[f"layers.{i}.feed_forward.w1"] = ColwiseParallel()
        plan[f"layers.{i}.feed_forward.w2"] = RowwiseParallel()
    if not cfg.tie_embeddings:  # an odd vocabulary (257 rows) splits unevenly: 129 / 128
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh, plan)
    model.to_empty(device="cpu")
    load_pretrained(model, checkpoint)
    return model


def _strided(checkpoint: PretrainedCheckpoint, mesh: DeviceMesh) -> nn.Module:
    """Every block parameter as FSDP over tensor parallel on the same dimension lays it out: _StridedShard(0), each
    rank holding interleaved row blocks (rows 0-7 of 16 → rank 0 holds 0-3 and 8-11). Weights only: no forward."""
    with torch.device("meta"):
        model = build_model(checkpoint.config)
    for module in model.layers.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            placements = [_StridedShard(0, split_factor=2)]
            sharded = distribute_tensor(param, mesh, placements, src_data_rank=None)  # type: ignore[list-item]
            setattr(module, name, nn.Parameter(sharded))
    model.to_empty(device="cpu")
    load_pretrained(model, checkpoint)
    return model


@torch.no_grad()
def _observe(model: nn.Module, *, forward: bool = True) -> dict[str, Any]:
    logits = model(TOKENS) if forward else torch.empty(0)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    weights, placements = {}, set()
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            placements.add(str(tuple(param.placements)))
            weights[name] = param.full_tensor()
        else:
            weights[name] = param.detach().clone()
    return {"logits": logits, "weights": weights, "placements": sorted(placements)}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
