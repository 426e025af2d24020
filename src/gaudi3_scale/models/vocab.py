"""Vocabulary padding: rows of the embedding and the output head past the tokenizer's `vocab_size`, there only so
the head has a row count the matmul kernels like (`ModelConfig.resolve_padding`: 64 on GPUs and Gaudi) or one that
splits over the tensor-parallel ranks. They are no tokens, so they take no part in the model's distribution: the
model's logits for them are the lowest finite value of their dtype (`mask_vocab_padding`), which softmax turns into
exactly zero probability. The loss, its gradient, the validation loss, the MLM accuracy and sampling are then those
of the unpadded model whatever the padding — one process, tensor parallel, CPU or GPU — and the padding rows get no
gradient. Exports for other frameworks drop them (`drop_vocab_padding`); parameter counts leave them out
(`models.counting`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from gaudi3_scale.models.config import ModelConfig

__all__ = ["VOCAB_TABLES", "drop_vocab_padding", "mask_vocab_padding"]

# The parameters with one row per vocabulary entry (bert's decoder bias one entry per row), by state-dict name.
VOCAB_TABLES = ("tok_embeddings.weight", "output.weight", "output.bias")


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int, *, copy: bool = False) -> torch.Tensor:
    """`logits` [..., padded vocabulary] with the padding columns (from `vocab_size` on) set to the lowest finite
    value of their dtype, in place; returned. Nothing is done without padding (the CPU default). `copy`: a masked
    copy instead, for logits autograd must not see written in place (the output of torchao's `Float8Linear`, a view
    made inside its custom Function: writing it would be refused at the next op).

    Only the padding columns are written (GPT-2 on a GPU: 47 of each row's 50,304) and nothing is added to
    backward; a full-size masked copy (`masked_fill`) or a slice (which cross-entropy copies to make it contiguous)
    would add a pass over the largest activation in forward and another in backward. The write goes through a
    detached alias, so autograd does not see it: the gradient a consumer gives those columns flows back unchanged,
    and for softmax cross-entropy it is exactly 0 (their probability underflows to 0). Under loss parallel the logits
    are a vocabulary-sharded DTensor; each rank writes the padding columns of its own block, no communication. The
    lowest finite value, not -inf, so that a reduction over a block of padding only (a rank's shard, a fused
    kernel's tile) gives no -inf - -inf NaN.
    """
    if logits.shape[-1] == vocab_size:
        return logits
    if copy:
        padding = torch.arange(logits.shape[-1], device=logits.device) >= vocab_size
        from torch.distributed.tensor.experimental import implicit_replication

        with implicit_replication():  # a sharded DTensor's columns meet the replicated column mask
            return logits.masked_fill(padding, torch.finfo(logits.dtype).min)
    local, first = _local_columns(logits.detach())
    start = max(vocab_size - first, 0)
    if start < local.shape[-1]:
        local.narrow(-1, start, local.shape[-1] - start).fill_(torch.finfo(local.dtype).min)
    return logits


def _local_columns(logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's block, global index of its first column) of logits that may be a DTensor sharded on the last
    dimension (chunks as `torch.chunk` cuts them, as DTensor's `Shard` does).

    Plain arithmetic on the mesh coordinate rather than torch's `compute_local_shape_and_global_offset` (which
    `models.common.init` uses on parameters): under torch.compile that one breaks the graph on an `.item()`, and the
    compiled loss came out wrong (torch 2.13, 2 CPU ranks)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(logits, DTensor):
        return logits, 0
    mesh, last = logits.device_mesh, logits.ndim - 1
    first, columns = 0, logits.shape[-1]
    for mesh_dim, placement in enumerate(logits.placements):
        if isinstance(placement, Shard) and placement.dim % logits.ndim == last:
            assert type(placement) is Shard, f"logits sharded as {placement}"  # contiguous blocks only
            chunk = -(-columns // mesh.size(mesh_dim))
            first += mesh.get_local_rank(mesh_dim) * chunk
            columns = chunk
    return logits.to_local(), first


def drop_vocab_padding(
    cfg: ModelConfig, state: dict[str, torch.Tensor]
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(`cfg` unpadded, `state` with its vocabulary tables cut to `vocab_size` rows): the model as a framework that
    knows nothing of our padding (Hugging Face) must see it, or it would sample token ids the tokenizer lacks."""
    assert cfg.vocab_size is not None, "a checkpoint's config has its vocabulary resolved"
    vocab = cfg.vocab_size
    return replace(cfg, pad_vocab_to_multiple=1), {
        name: tensor[:vocab] if name in VOCAB_TABLES else tensor for name, tensor in state.items()
    }
