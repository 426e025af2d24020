"""`parallel.offload` reaches the strategies: DeepSpeed's zero_optimization offload entries and FSDP2's offload flag
(the real training runs with offload are in tests/distributed/test_strategies.py)."""

from __future__ import annotations

import pytest

from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.distributed.strategies import build_strategy

BATCH = BatchPlan.build(global_batch_size=8, micro_batch_size=2, data_parallel_size=2)


@pytest.mark.parametrize(
    ("strategy", "offload", "expected"),
    [
        ("deepspeed_zero2", "none", set()),
        ("deepspeed_zero2", "optimizer", {"offload_optimizer"}),
        ("deepspeed_zero3", "optimizer", {"offload_optimizer"}),
        ("deepspeed_zero3", "all", {"offload_optimizer", "offload_param"}),
    ],
)
def test_deepspeed_offload_entries(strategy: str, offload: str, expected: set[str]) -> None:
    pytest.importorskip("deepspeed")
    plan = ParallelPlan(strategy=strategy, world_size=2, offload=offload)
    zero = build_strategy(plan, BATCH, accelerator="cpu").config["zero_optimization"]
    assert {key for key in zero if key.startswith("offload")} == expected
    for key in expected:  # gloo on a CPU: nothing to pin host memory for
        assert zero[key] == {"device": "cpu", "pin_memory": False}
    assert build_strategy(plan, BATCH, accelerator="cpu").config["zero_force_ds_cpu_optimizer"] is False


@pytest.mark.parametrize(("offload", "cpu_offload"), [("none", False), ("all", True)])
def test_fsdp_strategy_keeps_offloaded_shards_on_the_host(offload: str, cpu_offload: bool) -> None:
    plan = ParallelPlan(strategy="fsdp", world_size=2, offload=offload)
    assert build_strategy(plan, BATCH, accelerator="cpu").cpu_offload is cpu_offload
