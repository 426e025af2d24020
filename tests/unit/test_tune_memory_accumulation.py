"""The memory estimate with gradient accumulation (gradients kept across micro-steps) and the one number held
against a CPU memory budget (`process_peak_bytes`: the estimate plus what glibc keeps), as `gaudi3 plan` reports it.

Measured on this project's CPU (the hunt's r16 repro: llama-tiny 2 × 1024, 32-true, micro-batch 2): peak RSS
2.459 GiB at accumulation 1 and 2.754 GiB at accumulation 4; the estimate was 2.38 GiB for both before the kept
gradients were counted, 2.38 and 2.67 GiB after (−3.2 % and −3.0 %). DDP over 2 ranks (2 × 768): 2.053 and
2.424 GiB measured, 2.03 and 2.38 GiB estimated.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.models import get_model_config
from gaudi3_scale.tune.memory import (
    GLIBC_RETAINED_MAX_BYTES,
    GLIBC_RETAINED_SHARE,
    MMAP_THRESHOLD_ENV,
    MemoryEstimate,
    estimate_memory,
    max_micro_batch_that_fits,
    process_peak_bytes,
)

# The r16 shape, whose peak moves from backward end to backward start when gradients are kept.
LLAMA = replace(
    get_model_config("llama-tiny"), num_layers=2, dim=1024, ffn_dim=4096, num_heads=8, num_kv_heads=4,
    context_length=128, vocab_size=50257,  # the synthetic data's (GPT-2 tokenizer), as r16 ran it
)  # fmt: skip
F32 = 4  # bytes per fp32 gradient element (32-true)


def _estimate(
    strategy: str, world_size: int, accumulation: int, micro: int = 2, device_kind: str = "cpu"
) -> MemoryEstimate:
    plan = ParallelPlan.build(strategy=strategy, world_size=world_size)
    batch = BatchPlan.from_micro_batch(
        micro, accumulation=accumulation, data_parallel_size=plan.data_parallel_size
    )
    return estimate_memory(LLAMA, plan, batch, precision="32-true", device_kind=device_kind)


def test_one_process_keeps_the_whole_gradients_between_micro_batches() -> None:
    one, four = _estimate("auto", 1, 1), _estimate("auto", 1, 4)
    gradients = one.parameters * F32
    assert (one.peak_phase, one.grads_bytes) == ("backward end", gradients)
    # Backward start of micro-batch 2..4: the activations and loss workspace plus every gradient so far.
    assert (four.peak_phase, four.grads_bytes) == ("backward start", gradients)
    # Against the measured peaks of the module docstring: both within 5 % (before: 2.38 GiB for both, −13.6 % at 4).
    assert one.total_bytes / 2**30 == pytest.approx(2.459, rel=0.05)
    assert four.total_bytes / 2**30 == pytest.approx(2.754, rel=0.05)


def test_ddp_accumulates_beside_its_buckets_and_fsdp_and_zero2_keep_their_shard() -> None:
    ddp1, ddp4 = _estimate("ddp", 2, 1, device_kind="cuda"), _estimate("ddp", 2, 4, device_kind="cuda")
    gradients = ddp1.parameters * F32
    assert (
        ddp4.peak_phase == "backward start" and ddp4.grads_bytes == 2 * gradients
    )  # buckets + .grad tensors
    assert ddp4.total_bytes > ddp1.total_bytes
    # FSDP (micro-batch 16, so that backward start is the peak): the sharded gradients of backward end, not the
    # unsharded ones
    shard_grads = _estimate("fsdp", 4, 1, device_kind="cuda").grads_bytes  # at backward end
    fsdp1 = _estimate("fsdp", 4, 1, micro=16, device_kind="cuda")
    fsdp4 = _estimate("fsdp", 4, 4, micro=16, device_kind="cuda")
    assert (fsdp1.peak_phase, fsdp1.grads_bytes) == ("backward start", 0)
    assert (fsdp4.peak_phase, fsdp4.grads_bytes) == ("backward start", shard_grads)
    assert gradients / 4 <= shard_grads < gradients / 3
    zero1 = _estimate("deepspeed_zero2", 4, 1, device_kind="cuda")
    zero4 = _estimate("deepspeed_zero2", 4, 4, device_kind="cuda")
    assert zero4.peak_phase == "backward start" and zero4.grads_bytes == round(gradients / 4)
    assert zero4.total_bytes >= zero1.total_bytes
    # ZeRO-3 kept its gradient partition at backward start already; accumulation changes nothing there.
    assert _estimate("deepspeed_zero3", 4, 4).total_bytes == _estimate("deepspeed_zero3", 4, 1).total_bytes


def test_a_cpu_budget_holds_the_estimate_plus_what_glibc_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MMAP_THRESHOLD_ENV, raising=False)
    cpu = _estimate("auto", 1, 1, device_kind="cpu")
    # 2.38 GiB: the cap, not 16 % (measured 2.459 GiB: 16 % would say +12 %, the cap +2.8 %)
    assert process_peak_bytes(cpu) == cpu.total_bytes + GLIBC_RETAINED_MAX_BYTES
    assert process_peak_bytes(cpu) / 2**30 == pytest.approx(2.459, rel=0.03)
    char = replace(get_model_config("shakespeare-char"), vocab_size=65)
    small = estimate_memory(char, ParallelPlan.build(), BatchPlan.from_micro_batch(8))
    assert small.total_bytes < 0.8e9  # as bench_foresight's cases, where 16 % was fitted
    assert process_peak_bytes(small) == small.total_bytes + round(small.total_bytes * GLIBC_RETAINED_SHARE[0])
    assert process_peak_bytes(cpu, {MMAP_THRESHOLD_ENV: "131072"}) == cpu.total_bytes
    cuda = _estimate("auto", 1, 1, device_kind="cuda")
    assert (
        process_peak_bytes(cuda) == cuda.total_bytes
    )  # a device allocator's peak is what the estimate counts
    # max_micro_batch_that_fits holds the same number against its budget (micro-batch 16: activations dominate)
    plan = ParallelPlan.build(strategy="auto")
    sixteen = _estimate("auto", 1, 1, micro=16, device_kind="cpu")
    assert (
        max_micro_batch_that_fits(LLAMA, plan, budget_bytes=process_peak_bytes(sixteen), precision="32-true")
        == 16
    )
    assert max_micro_batch_that_fits(LLAMA, plan, budget_bytes=sixteen.total_bytes, precision="32-true") < 16
    with_accumulation = max_micro_batch_that_fits(
        LLAMA, plan, budget_bytes=process_peak_bytes(sixteen), precision="32-true", accumulation=4
    )
    assert with_accumulation < 16


def test_plan_reports_the_number_a_budget_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gaudi3 plan`'s per-rank total is `process_peak_bytes` of the tuner's estimate, term by term."""
    from gaudi3_scale.forecast.model import _memory
    from gaudi3_scale.forecast.shape import RunShape

    monkeypatch.delenv(MMAP_THRESHOLD_ENV, raising=False)
    plan = ParallelPlan.build(strategy="auto")
    batch = BatchPlan.from_micro_batch(2, accumulation=4)
    shape = RunShape.build(
        LLAMA, plan, batch, precision="32-true", device_kind="cpu", nodes=1, ranks_per_node=1
    )
    estimate = estimate_memory(LLAMA, plan, batch, precision="32-true", device_kind="cpu")
    memory = _memory(shape, None)
    assert memory["total_bytes"].value == process_peak_bytes(estimate)
    assert memory["allocator_bytes"].value == process_peak_bytes(estimate) - estimate.total_bytes > 0
