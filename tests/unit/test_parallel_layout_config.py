"""Tensor parallel, HSDP and offload settings: checked against the launch geometry, the strategy and the model's
head counts, one line each; the plans divide the world into tensor-parallel groups."""

from __future__ import annotations

import pytest

from gaudi3_scale.config import ConfigError
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.train.config import RunConfig
from gaudi3_scale.train.config import build_run_config as _build


def build_run_config(overrides: list[str]) -> RunConfig:
    return _build(overrides=[tuple(item.split("=", 1)) for item in overrides])  # type: ignore[misc]


LLAMA = ["model.name=llama-tiny"]  # 4 heads, 2 kv heads, ffn 192


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.nproc_per_node=4", "parallel.tp_size=3"], r"^parallel\.tp_size: must divide nproc_per_node \(4\)"),
        (["parallel.nproc_per_node=2", "parallel.tp_size=2"], r"^parallel\.tp_size: .*arch llama, not gpt2"),
        ([*LLAMA, "parallel.nproc_per_node=4", "parallel.tp_size=4"],
         r"^parallel\.tp_size: 4 must divide model\.num_kv_heads \(2\)"),
        ([*LLAMA, "parallel.nproc_per_node=2", "parallel.tp_size=2", "parallel.strategy=ddp"],
         r"^parallel\.tp_size: runs on an FSDP2 device mesh; allowed with parallel\.strategy auto, fsdp, "
         r"fsdp_grad_op, not ddp"),
        (["parallel.nproc_per_node=4", "parallel.dp_replicate=3"],
         r"^parallel\.dp_replicate: must divide the data-parallel ranks \(world_size 4 / tp_size 1 = 4\)"),
        (["parallel.nproc_per_node=2", "parallel.strategy=ddp", "parallel.dp_replicate=2"],
         r"^parallel\.dp_replicate: runs on an FSDP2 device mesh"),
        (["parallel.offload=all"], r"^parallel\.offload: all needs parallel\.strategy fsdp, fsdp_grad_op, "
         r"deepspeed_zero3, not auto$"),
        (["parallel.offload=optimizer", "parallel.strategy=fsdp"],
         r"^parallel\.offload: optimizer needs parallel\.strategy deepspeed_zero2, deepspeed_zero3, not fsdp$"),
        (["parallel.offload=params"], r"^parallel\.offload: got 'params'; allowed: none, optimizer, all$"),
        (["parallel.tp_size=0"], r"^parallel\.tp_size: "),
        ([*LLAMA, "model.context_length=63", "parallel.nproc_per_node=2", "parallel.tp_size=2"],
         r"^parallel\.tp_size: 2 must divide model\.context_length \(63\)"),  # sequence parallel splits it
        ([*LLAMA, "parallel.nproc_per_node=2", "parallel.tp_size=2", "train.precision=fp8"],
         r"^train\.precision: fp8 swaps linears that tensor parallel has already sharded"),
    ],
)  # fmt: skip
def test_bad_layouts_are_one_line_naming_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_run_config(overrides=overrides)


def test_tensor_parallel_groups_read_one_batch_and_auto_picks_fsdp() -> None:
    cfg = build_run_config(
        overrides=[*LLAMA, "parallel.nproc_per_node=4", "parallel.tp_size=2", "train.global_batch_size=8"]
    )
    batch, plan = cfg.batch_plan(), cfg.parallel_plan()
    assert (batch.data_parallel_size, batch.per_rank_batch_size) == (2, 4)
    assert (plan.strategy, plan.tp_size, plan.data_parallel_size, plan.dp_shard) == ("fsdp", 2, 2, 2)


def test_hsdp_splits_the_data_parallel_ranks_into_replicas_of_shards() -> None:
    cfg = build_run_config(
        overrides=[
            "parallel.nproc_per_node=4",
            "parallel.strategy=fsdp",
            "parallel.dp_replicate=2",
            "parallel.offload=all",
        ]
    )
    plan = cfg.parallel_plan()
    assert (plan.strategy, plan.dp_replicate, plan.dp_shard, plan.offload) == ("fsdp", 2, 2, "all")
    assert cfg.batch_plan().data_parallel_size == 4


def test_the_vocabulary_is_padded_to_split_over_tensor_parallel_ranks() -> None:
    cfg = build_run_config(overrides=LLAMA).model.resolve_vocab(65)
    assert cfg.resolve_padding("cpu").padded_vocab_size == 65
    assert cfg.resolve_padding("cpu", tp_size=2).padded_vocab_size == 66
    assert cfg.resolve_padding("cuda", tp_size=2).padded_vocab_size == 128  # the GPU multiple splits already
    assert cfg.resolve_padding("cpu", tp_size=3).padded_vocab_size == 65  # not a power of two: refused later


def test_data_parallel_rank_is_the_tensor_parallel_group() -> None:
    from gaudi3_scale.distributed.mesh import data_parallel_rank

    assert [data_parallel_rank(rank, 2) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [data_parallel_rank(rank, 1) for rank in range(3)] == [0, 1, 2]


@pytest.mark.parametrize(
    ("layout", "strategy"),
    [
        ({}, "single"),
        ({"world_size": 2}, "ddp"),
        ({"world_size": 2, "tp_size": 2}, "fsdp"),
        ({"world_size": 4, "dp_replicate": 2}, "fsdp"),
        ({"strategy": "deepspeed_zero3", "world_size": 2, "offload": "all"}, "deepspeed_zero3"),
    ],
)
def test_a_what_if_plan_resolves_as_a_run_does(layout: dict, strategy: str) -> None:
    # The tuner, the layout table and the cost planner build their plans with ParallelPlan.build; a run builds its
    # own from the config (RunConfig.parallel_plan): one resolution, the same answer.
    plan = ParallelPlan.build(**layout)
    world = layout.get("world_size", 1)
    fields = {k: v for k, v in layout.items() if k != "world_size"}
    cfg = build_run_config(
        [*LLAMA, f"parallel.nproc_per_node={world}", *(f"parallel.{k}={v}" for k, v in fields.items())]
    )
    assert plan.strategy == cfg.parallel_plan().strategy == strategy
    assert plan.partitions_parameters == (strategy == "deepspeed_zero3")


def test_a_what_if_plan_refuses_what_a_run_config_refuses() -> None:
    with pytest.raises(ConfigError, match=r"^parallel\.strategy: must be one of auto, ddp, "):
        ParallelPlan.build(strategy="zero9")
    with pytest.raises(ConfigError, match=r"^parallel\.tp_size: runs on an FSDP2 device mesh"):
        ParallelPlan.build(strategy="ddp", world_size=2, tp_size=2)
    with pytest.raises(
        ConfigError, match=r"^parallel\.offload: all needs parallel\.strategy fsdp, .* not auto$"
    ):
        ParallelPlan.build(world_size=2, offload="all")


def test_one_hpu_runs_as_ddp_and_a_micro_batch_plan_makes_its_global_batch() -> None:
    assert ParallelPlan().runs_as("hpu") == "ddp"  # the HCCL strategy, as lightning-habana did
    assert ParallelPlan().runs_as("cuda") == "single"
    assert ParallelPlan.build(world_size=2).runs_as("hpu") == "ddp"
    batch = BatchPlan.from_micro_batch(4, accumulation=2, data_parallel_size=3, context_length=8)
    assert (batch.global_batch_size, batch.per_rank_batch_size, batch.tokens_per_step) == (24, 8, 24 * 8)
    assert batch == BatchPlan.build(
        global_batch_size=24, micro_batch_size=4, data_parallel_size=3, context_length=8
    )
