"""Parallelism applied to a single-device model from the outside, in torchtitan's order:
activation checkpointing → compile → FSDP. DDP needs nothing here: Lightning's DDPStrategy wraps the module.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing", "apply_fsdp", "find_blocks"]


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's list of repeated blocks: its `layers` (ours, Llama-style), else the largest `nn.ModuleList` whose
    items all share one class (`transformer.h` in GPT-2-style models)."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return layers
    candidates = [
        module
        for module in model.modules()
        if isinstance(module, nn.ModuleList) and len(module) and len({type(item) for item in module}) == 1
    ]
    if not candidates:
        raise ValueError(
            f"activation checkpointing needs a model with a ModuleList of repeated blocks; "
            f"{type(model).__name__} has none"
        )
    return max(candidates, key=len)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute every transformer block in backward (Chen et al. 2016, "Training Deep Nets with Sublinear Memory");
    returns how many blocks.

    The block's `forward` is replaced on the instance, not wrapped in another module, so parameter names — and
    therefore checkpoints — are the same with and without activation checkpointing.
    """
    layers = find_blocks(model)
    for block in layers:
        original = block.forward
        if getattr(original, "activation_checkpointed", False):
            continue  # applied already: checkpointing twice would recompute twice

        def checkpointed(*args: Any, _forward: Any = original, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = functools.wraps(original)(checkpointed)
        block.forward.activation_checkpointed = True  # type: ignore[attr-defined]
    return len(layers)


def apply_fsdp(
    model: nn.Module,
    mesh: Any,
    *,
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None = None,
) -> None:
    """FSDP2 `fully_shard` per transformer block, then the root (embeddings, final norm, head).

    reshard_after_forward=True frees gathered parameters after each block's forward and gathers them again for
    backward (ZeRO-3); False keeps them until backward (ZeRO-2 style: gradients and optimizer state sharded).
    The tied GPT-2 embedding/head live in the root unit together, as tying requires.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    )
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if policy is not None:
        kwargs["mp_policy"] = policy
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError("FSDP needs a model with a `layers` ModuleList of blocks")
    for block in layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
