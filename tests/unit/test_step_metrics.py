"""Step metrics under a parallel layout (train.step_metrics.RunMetrics): samples/s counts the ranks that read
different batches, and under tensor parallel the ranks of a group read the same one, so a record's samples/s times
the context length is its tokens/s on every layout; MFU still divides by every rank's device.

A tensor-parallel layout needs several real ranks (tests/distributed/test_tensor_parallel.py trains one). Here the
Lightning trainer is a stand-in with the fields RunMetrics reads, as rank 0 of 4 ranks in tensor-parallel pairs
sees them, fed the micro-batches rank 0 reads; the parts that build RunMetrics are real."""

from __future__ import annotations

import io
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rich.console import Console

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.device import DevicePlan
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.monitor.perf import mfu
from gaudi3_scale.train.config import build_run_config
from gaudi3_scale.train.parts import build_after_step
from gaudi3_scale.train.step import StepState
from gaudi3_scale.train.step_metrics import RunMetrics

CONTEXT = 16
FLOPS_PER_TOKEN, PEAK_FLOPS = 1e6, 1e12


def _rank0_of(world_size: int) -> Any:
    """What RunMetrics reads of Lightning's Trainer on rank 0 (the loss mean is already the ranks' own here)."""
    reduce = SimpleNamespace(reduce=lambda value, reduce_op: value)
    return SimpleNamespace(
        world_size=world_size, global_step=0, max_steps=4, is_global_zero=True, strategy=reduce
    )


def test_samples_per_s_counts_the_data_parallel_ranks_under_tensor_parallel(tmp_path: Path) -> None:
    plan = ParallelPlan.build(strategy="fsdp", world_size=4, tp_size=2)
    batch = BatchPlan.build(global_batch_size=8, micro_batch_size=2, data_parallel_size=plan.data_parallel_size,
                            context_length=CONTEXT)  # fmt: skip
    assert (batch.data_parallel_size, batch.accumulation) == (2, 2)  # 2 pairs, 2 micro-batches of 2 each
    state = StepState.for_plan(batch, flops_per_token=FLOPS_PER_TOKEN)
    metrics = RunMetrics(tmp_path / "metrics.jsonl", log_every_steps=2, state=state, peak_flops_per_device=PEAK_FLOPS,
                         data_parallel_size=plan.data_parallel_size)  # fmt: skip
    trainer, module = _rank0_of(plan.world_size), SimpleNamespace(device=torch.device("cpu"))
    records: list[dict] = []
    metrics.listeners.append(records.append)
    metrics.start(trainer, module)  # type: ignore[arg-type]
    for step in (1, 2):
        for _ in range(batch.accumulation):
            metrics.batch_start()
            time.sleep(0.01)  # the step's work
            metrics.batch_end(torch.zeros(batch.micro_batch_size, CONTEXT, dtype=torch.long))
            metrics.batch_done()
        state.loss, trainer.global_step = torch.tensor(2.0), step
        metrics.after_step(trainer, module)  # type: ignore[arg-type]
    metrics.end()
    (record,) = [r for r in records if "samples_per_s" in r]
    assert record["window_steps"] == 2 and record["tokens_per_s"] > 0
    # 8 sequences of 16 tokens per step: rank 0 read 4 of them, its pair's other rank the same 4, the other pair 4 more.
    assert record["samples_per_s"] * CONTEXT == pytest.approx(record["tokens_per_s"], rel=1e-9)
    assert record["mfu"] == pytest.approx(
        mfu(record["tokens_per_s"], FLOPS_PER_TOKEN, PEAK_FLOPS, 4), rel=1e-9
    )


def test_the_run_metrics_take_the_data_parallel_size_of_the_runs_plan(tmp_path: Path) -> None:
    overrides = ["--model.name=llama-tiny", "--parallel.strategy=fsdp", "--parallel.nproc_per_node=4",
                 "--parallel.tp_size=2", f"--out_dir={tmp_path}"]  # fmt: skip
    cfg = build_run_config(None, parse_overrides(overrides))
    device = DevicePlan(
        accelerator="cpu", precision="32-true", device_name="cpu", peak_flops=None, peak_source="-"
    )
    lines: list[str] = []
    after, health = build_after_step(
        cfg, StepState(), strategy=None, parallel=cfg.parallel_plan(), device=device, guard=None, data_sha256=None,
        our_model=True, rank=0, console=Console(file=io.StringIO()), progress=False, warn=lines.append,
        note=lines.append,
    )  # fmt: skip
    try:
        assert after.metrics.data_parallel_size == 2 and health is None and lines == []
    finally:
        after.checkpoint.checkpointer.close()
