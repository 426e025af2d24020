"""`health.collective_timeout_s` reaches the process group: every strategy `build_strategy` makes hands Lightning the
timeout it passes to `torch.distributed.init_process_group` (instead of the 30-minute default)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.distributed.strategies import build_strategy

BATCH = BatchPlan.build(global_batch_size=8, micro_batch_size=2, data_parallel_size=2)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp_grad_op", "deepspeed_zero2"])
def test_the_process_group_timeout_is_the_configured_one(strategy: str) -> None:
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    plan = ParallelPlan(strategy=strategy, world_size=2)
    built = build_strategy(plan, BATCH, accelerator="cpu", collective_timeout_s=42.5)
    assert built._timeout == timedelta(seconds=42.5)
