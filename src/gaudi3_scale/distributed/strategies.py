"""Run config strategy name → Lightning strategy object.

Lightning's FSDPStrategy refuses the CPU accelerator; ModelParallelStrategy (FSDP2 `fully_shard`, applied by us in
`configure_model`) runs on CPU with gloo, on CUDA with NCCL and on Gaudi with HCCL (an hpu device mesh; not yet
validated on Gaudi hardware), so both FSDP flavours use it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan

__all__ = [
    "STRATEGIES_BY_DEVICE",
    "build_strategy",
    "check_strategy_on",
    "saves_sharded",
    "supported_strategies",
]

# Resolved strategies the trainer builds on each device kind (what the tuner and the cost planner may propose).
# On Gaudi: DDP and FSDP2 over HCCL on an hpu device mesh (tensor parallel and HSDP are meshes of the same FSDP
# strategy), not yet validated on Gaudi hardware; DeepSpeed needs Intel's fork (HabanaAI/DeepSpeed), which our
# ZeroStrategy is not built or tested against, so it is refused there.
STRATEGIES_BY_DEVICE = {
    "cpu": ("single", "ddp", "fsdp", "fsdp_grad_op", "deepspeed_zero2", "deepspeed_zero3"),
    "cuda": ("single", "ddp", "fsdp", "fsdp_grad_op", "deepspeed_zero2", "deepspeed_zero3"),
    "hpu": ("single", "ddp", "fsdp", "fsdp_grad_op"),
}


def supported_strategies(device_kind: str) -> tuple[str, ...]:
    """The resolved strategies `build_strategy` builds on `device_kind` (cpu, cuda or hpu)."""
    return STRATEGIES_BY_DEVICE[device_kind]


def check_strategy_on(name: str, device_kind: str) -> None:
    """Refuse a resolved strategy (`ParallelPlan.runs_as`) that `build_strategy` does not build on `device_kind`:
    the trainer's check, also run by `gaudi3 plan` and `gaudi3 deploy render` before any node starts."""
    if device_kind == "hpu" and name not in STRATEGIES_BY_DEVICE["hpu"]:
        raise ConfigError(
            "parallel.strategy",
            f"{name} is not available on Gaudi (DeepSpeed on Gaudi is Intel's fork, not supported here); "
            "allowed on hpu: auto, ddp, fsdp, fsdp_grad_op",
        )


def build_strategy(
    plan: ParallelPlan,
    batch: BatchPlan,
    *,
    accelerator: str,
    grad_clip_norm: float = 0.0,
    hidden_size: int = 768,
    collective_timeout_s: float = 1800.0,
) -> Any:
    """The Lightning strategy that runs `plan` (or "auto" for one process).

    DeepSpeed also needs the batch split and clipping, and sizes its communication buckets from the hidden size.
    `collective_timeout_s` is the process group's timeout for one collective (`health.collective_timeout_s`).
    """
    timeout = timedelta(seconds=collective_timeout_s)
    backend = "nccl" if accelerator == "cuda" else "gloo"
    name = plan.runs_as(accelerator)
    if name == "single":
        return "auto"
    check_strategy_on(name, accelerator)
    if accelerator == "hpu":
        from gaudi3_scale.distributed.hpu import HPUDDPStrategy, register_hpu_strategies

        register_hpu_strategies()
        if name == "ddp":
            return HPUDDPStrategy(timeout=timeout)
    if plan.uses_deepspeed:  # built lazily: deepspeed is an optional extra
        from gaudi3_scale.distributed.deepspeed import build_zero_strategy

        return build_zero_strategy(
            name,
            accelerator=accelerator,
            backend=backend,
            micro_batch_size=batch.micro_batch_size,
            accumulation=batch.accumulation,
            grad_clip_norm=grad_clip_norm,
            hidden_size=hidden_size,
            offload=plan.offload,
            timeout=timeout,
        )
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        # Gradients live in DDP's all-reduce buckets instead of being copied into them: one gradient-sized
        # buffer less per rank, and one copy less per step.
        return DDPStrategy(process_group_backend=backend, gradient_as_bucket_view=True, timeout=timeout)
    from gaudi3_scale.distributed.fsdp import FSDPStrategy

    fsdp_class: type[FSDPStrategy] = FSDPStrategy
    if accelerator == "hpu":  # HCCL, on an hpu device mesh; not yet validated on Gaudi hardware
        from gaudi3_scale.distributed.hpu import HPUFSDPStrategy

        fsdp_class, backend = HPUFSDPStrategy, "hccl"
    # Checkpoints through torch.distributed.checkpoint: each rank writes its own shards (see checkpoint.sharded).
    strategy = fsdp_class(
        tp_size=plan.tp_size,
        dp_replicate=plan.dp_replicate,
        pp_size=plan.pp_size,
        save_distributed_checkpoint=True,
        process_group_backend=backend,
        timeout=timeout,
    )
    strategy.cpu_offload = plan.offload == "all"
    return strategy


def saves_sharded(strategy: object) -> bool:
    """Whether the strategy writes one shard file per rank (DCP) instead of one file on rank 0."""
    return bool(getattr(strategy, "_save_distributed_checkpoint", False))
