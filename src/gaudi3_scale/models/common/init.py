"""Weight initialisation that does not depend on how the weights are laid out over devices.

A parameter's initial values are a function of (seed, parameter name, element index) only. The flattened tensor
is cut into fixed chunks of `CHUNK_ELEMENTS`; chunk k is drawn from a generator seeded with (seed, name, k). A rank
that holds one shard of the parameter (an FSDP2 `Shard(0)` DTensor, or a tensor-parallel `Shard(1)` one) draws only
the chunks its shard overlaps, so a model materialised shard by shard on any number of ranks holds bitwise the
weights one process would build — and no rank ever allocates more than its shards plus one chunk.

(torch's CPU generator cannot skip ahead, and DTensor's offset-based RNG only exists for CUDA-like devices; per-chunk
seeding gives the same answer on every device and world size.)
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

__all__ = ["CHUNK_ELEMENTS", "Embedding", "fill_normal", "logical_shape"]

CHUNK_ELEMENTS = 1 << 16  # a multiple of 16: torch's vectorised normal sampler fills whole blocks of 16
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive chunk indices over the seed space
_MASK64 = (1 << 64) - 1


def logical_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape the model defines for `param`. A parameter DeepSpeed ZeRO-3 partitioned (built under `zero.Init`,
    which also partitions a model built there on meta) is an empty placeholder that keeps its shape in `ds_shape`."""
    shape = getattr(param, "ds_shape", None)
    return tuple(shape) if shape is not None else tuple(param.shape)


def _key(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def _local_block(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, global shape, global offset of the local block) for a tensor or a DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), tuple(tensor.shape), tuple(offset)
    return tensor, tuple(tensor.shape), (0,) * tensor.ndim


@torch.no_grad()
def fill_normal(tensor: torch.Tensor, std: float, *, seed: int, name: str) -> None:
    """Fill `tensor` (or this rank's block of a DTensor) with N(0, std²) values that depend only on (seed, name,
    element index in the full tensor)."""
    local, shape, offset = _local_block(tensor)
    if local.numel() == 0:
        return
    key = _key(seed, name)
    if local.ndim <= 2:
        _fill_block(local, shape, offset, std, key=key)
    elif tuple(local.shape[1:]) == shape[1:]:
        # Batched weights (the MoE experts' [E, dim, hidden]) whole or split on dim 0 (FSDP's Shard(0), a future
        # expert parallel): rows of the flattened trailing dims.
        _fill_block(local.flatten(1), (shape[0], math.prod(shape[1:])), (offset[0], 0), std, key=key)
    elif local.ndim == 3 and (local.shape[0], local.shape[2]) == (shape[0], shape[2]):
        # Split on dim 1 (FSDP when the experts do not divide over the ranks, distributed.shard_plan): expert e's
        # block is rows e·dim + offset .. of the [E·dim, hidden] view of the full tensor.
        rows = (shape[0] * shape[1], shape[2])
        for e in range(shape[0]):
            _fill_block(local[e], rows, (e * shape[1] + offset[1], 0), std, key=key)
    else:
        raise ValueError(f"{name}: a {len(shape)}-D parameter may be sharded on dim 0 or 1 only, got {shape}")


def _fill_block(
    local: torch.Tensor, shape: tuple[int, ...], offset: tuple[int, ...], std: float, *, key: int
) -> None:
    """`local` (≤ 2-D), the block at `offset` of a full tensor of `shape`, from the full tensor's draws."""
    cached: tuple[int, torch.Tensor] | None = None

    def chunk(k: int) -> torch.Tensor:
        nonlocal cached
        if cached is None or cached[0] != k:
            generator = torch.Generator().manual_seed((key + k * _GOLDEN) & _MASK64)
            # always on the host: a default device (`with torch.device("cuda")`) must not move the draw
            cached = (k, torch.randn(CHUNK_ELEMENTS, generator=generator, device="cpu"))
        return cached[1]

    def segment(start: int, length: int) -> torch.Tensor:
        """Elements [start, start + length) of the flattened full tensor, in float32."""
        out = torch.empty(length, device="cpu")
        done = 0
        while done < length:
            k, within = divmod(start + done, CHUNK_ELEMENTS)
            take = min(length - done, CHUNK_ELEMENTS - within)
            out[done : done + take] = chunk(k)[within : within + take]
            done += take
        return out

    rows = local if local.ndim == 2 else local.view(1, -1)
    row_length = shape[1] if len(shape) == 2 else shape[0]
    first_row = offset[0] if len(shape) == 2 else 0
    first_col = offset[1] if len(shape) == 2 else offset[0]
    if rows.shape[1] == row_length:  # whole rows: one contiguous segment of the flattened tensor
        values = segment(first_row * row_length, rows.numel()).view(rows.shape)
    else:  # a column block (tensor parallel Shard(1)): one segment per row
        values = torch.stack(
            [segment((first_row + i) * row_length + first_col, rows.shape[1]) for i in range(rows.shape[0])]
        )
    rows.copy_(values.mul_(std))


class Embedding(nn.Embedding):
    """`nn.Embedding` that skips its own init on the meta device, where the models are built (`build_model`) and
    counted (plan, tune --estimate-only, the launcher's forecast) before `init_weights` fills them: `normal_` on a
    meta tensor runs torch's Python decomposition, whose first call imports torch._dynamo (1.1 s on a 2-core AMD
    EPYC, 2026-11-29) to draw nothing. On any other device, as `nn.Embedding`."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()
