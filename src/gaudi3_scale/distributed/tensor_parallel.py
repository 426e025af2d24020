"""Tensor parallel for Llama (Megatron-LM's layout, Shoeybi et al. 2019, arXiv:1909.08053) with sequence parallel
for the norms (Korthikanti et al. 2022, arXiv:2205.05198), through DTensor's `parallelize_module`.

Per block, on the `tensor_parallel` mesh dimension:

    attention_norm, ffn_norm   SequenceParallel: the residual stream is split on the sequence dimension
    attention, feed_forward    their input all-gathered to the whole sequence (PrepareModuleInput)
    wq, wk, wv, w1, w3         ColwiseParallel: each rank holds num_heads/tp query heads, kv_heads/tp key/value heads
                               and ffn_dim/tp MLP columns; attention reshapes to -1 heads, so it runs on local heads
    wo, w2                     RowwiseParallel: partial sums reduce-scattered back onto sequence shards

and for the model: token embeddings row-wise over the vocabulary (output sequence-sharded), the final norm
sequence-parallel, the output head column-wise over the vocabulary. Parameter names do not change, so checkpoints
are the same under any layout (DCP reshards DTensors on load).

Loss parallel. The head's logits stay sharded on the vocabulary dimension and cross-entropy runs on the shards
(`loss_parallel`): each rank reduces its own columns, and only [tokens] sized max / sum-exp / target values cross
ranks, never the [tokens, vocab] logits — the largest activation of a small-dim, large-vocabulary model such as
Llama 3 (128,256 columns). DTensor dispatches the loss's backward to the sharded kernels too, so forward and backward
run inside `loss_parallel()`: `TensorParallel.step_context` is that context, and the training step enters it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["apply_tensor_parallel", "local_loss", "step_context"]


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any) -> None:
    """Shard a Llama `Transformer` (models.transformer) over the 1-D `tp_mesh`, in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if getattr(model, "pos_embeddings", None) is not None or not isinstance(model.layers, nn.ModuleList):
        raise ValueError("tensor parallel is laid out for the Llama transformer (RoPE, no learned positions)")
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Logits left as a vocabulary-sharded DTensor for the loss (see the module docstring).
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    # A pipeline stage holds some of them (distributed.pipeline); between stages the residual stream stays a
    # sequence shard, as between blocks.
    present = {name: style for name, style in top.items() if getattr(model, name, None) is not None}
    if present:
        parallelize_module(model, tp_mesh, present)
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                # The rope cache (second input) is a plain tensor every rank holds whole.
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


def step_context(tensor_parallel: bool) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """What the forward and backward of a training or evaluation step run inside: `loss_parallel` under tensor
    parallel (cross-entropy on vocabulary-sharded logits), else nothing."""
    if not tensor_parallel:
        return contextlib.nullcontext
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor: under loss parallel it is a replicated 0-d DTensor (the same on every TP rank)."""
    from torch.distributed.tensor import DTensor

    return loss.to_local() if isinstance(loss, DTensor) else loss
