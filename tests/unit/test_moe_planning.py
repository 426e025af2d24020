"""Mixture-of-experts planning: FSDP shards Mixtral evenly (experts on dim 1 when they do not divide over the
ranks), the memory estimate sizes shards by the rank the plan gives the most, and `tune --estimate-only` lists
Mixtral's layouts instead of refusing tensor parallel it never asked for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.distributed.shard_plan import (
    fsdp_shard_dim,
    largest_rank_elements,
    parameter_bytes_per_rank,
)
from gaudi3_scale.models import build_model, get_model_config
from gaudi3_scale.tune.layouts import tensor_parallel_sizes
from gaudi3_scale.tune.memory import estimate_memory

MIXTRAL = get_model_config("mixtral-8x7b")


def test_mixtral_on_16_ranks_is_sharded_evenly() -> None:
    with torch.device("meta"):
        model = build_model(MIXTRAL)
    per_rank = parameter_bytes_per_rank(model, ParallelPlan(strategy="fsdp", world_size=16), element_bytes=2)
    # Experts on dim 0 put a whole expert on ranks 0-7 and none on 8-15 (21.4 against 0.4 GiB in bf16 weights).
    assert max(per_rank) / min(per_rank) < 1.001, (max(per_rank) / 2**30, min(per_rank) / 2**30)
    assert sum(per_rank) == 2 * sum(p.numel() for p in model.parameters())
    assert fsdp_shard_dim((8, 4096, 14336), 16) == 1 and fsdp_shard_dim((8, 4096, 14336), 8) == 0
    assert fsdp_shard_dim((32000, 4096), 16) == 0  # 2-D weights always on dim 0


def test_the_estimate_sizes_fsdp_shards_by_the_largest_rank() -> None:
    # 3 experts over 2 ranks go on dim 1 (even); a 98-row vocabulary over 3 ranks gives 33, 33, 32 rows.
    for cfg, ranks in ((replace(get_model_config("moe-tiny"), num_experts=3, vocab_size=98), 2),
                       (get_model_config("llama-tiny").resolve_vocab(98), 3)):  # fmt: skip
        with torch.device("meta"):
            model = build_model(cfg)
        largest = largest_rank_elements(model, ParallelPlan(strategy="fsdp", world_size=ranks))
        fsdp = ParallelPlan.build(strategy="fsdp", world_size=ranks)
        batch = BatchPlan.from_micro_batch(1, data_parallel_size=ranks)
        est = estimate_memory(cfg, fsdp, batch, precision="32-true", device_kind="cuda")
        assert est.optimizer_bytes == 2 * 4 * largest  # AdamW's two fp32 moments of the largest rank's shards
        assert largest > sum(p.numel() for p in model.parameters()) / ranks


def test_mixtral_layouts_on_16_h100(gaudi3_cli: Callable[..., tuple[int, str, str]]) -> None:
    assert tensor_parallel_sizes(MIXTRAL, 8) == [1]  # the run config refuses tensor parallel of MoE blocks
    code, out, err = gaudi3_cli(
        "tune",
        "--estimate-only",
        "--model.name",
        "mixtral-8x7b",
        "--accelerator",
        "h100",
        "--world-size",
        "16",
    )
    assert code == 0, err
    assert "mixtral-8x7b: 46.7 B parameters on 16 × h100-sxm" in out
    assert "fits          fsdp tp 1 × replicate 1 × shard 16, act.ckpt on, offload none" in out
    assert "tp 2" not in out and "tensor parallel of mixture" not in out + err
