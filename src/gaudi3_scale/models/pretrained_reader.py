"""Pretrained weights into a model laid out any way: `load_pretrained(model, checkpoint)` for a checkpoint that
`models.pretrained.open_pretrained` checked (`model.init_from`, serving an export).

Each rank reads only what it holds. For every parameter (a plain tensor, or a DTensor with any Shard placements
over a 1-D or 2-D mesh: FSDP's Shard(0), tensor parallel's Shard(0) / Shard(1), FSDP over tensor parallel's
_StridedShard) we compute which global rows and columns its local block holds and read just those rectangles:
runs of whole rows as plain reads of their byte range (chunked, no whole tensor in memory), anything else with
safetensors' `get_slice` on the memory-mapped file. No rank materialises a tensor it does not hold.

Why not DCP's `HuggingFaceStorageReader` (it exists in torch 2.13)? It loads tensors under their stored names and
shapes, so HF's rotate-half wq / wk rows and GPT-2's transposed, fused `c_attn` would land on the wrong ranks and
need a redistribution afterwards; with a `Source` (models.hf) we map our rectangle to the stored one instead
(whole heads for the RoPE rows, swapped indices for Conv1D, an offset into c_attn) and read it directly. Values
are cast to the parameter's dtype (checkpoints are often bf16; parameters fp32).

Rows the checkpoint does not have — vocabulary padding beyond its vocab (`model.pad_vocab_to_multiple`) — get the
normal init (`models.common.init.fill_normal`, layout-independent); rows the model does not have (a shorter
`context_length` than GPT-2's position table) are not read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.models.common.init import fill_normal
from gaudi3_scale.models.counting import parameter_shapes
from gaudi3_scale.models.hf import Source, permute_rope_rows
from gaudi3_scale.models.pretrained import FLOAT_DTYPES, PretrainedCheckpoint, import_safe_open
from gaudi3_scale.models.transformer import INIT_STD, Transformer

__all__ = ["load_pretrained"]


@torch.no_grad()
def load_pretrained(
    model: nn.Module,
    checkpoint: PretrainedCheckpoint,
    *,
    seed: int = 0,
    gathered: Callable[[list[nn.Parameter]], AbstractContextManager[Any]] | None = None,
) -> None:
    """Fill every parameter of `model` (a `Transformer` after `to_empty`, plain or sharded) from `checkpoint`, each
    rank reading only its blocks, and rebuild the non-persistent buffers (the RoPE cache).

    `seed` is for rows the checkpoint does not have (vocabulary padding): they get the normal init of that seed.
    `gathered(params)`, as in `Transformer.init_weights`, is entered around each module's parameters when they are
    partitioned where this reader cannot see (DeepSpeed ZeRO-3): each rank then reads that module's whole tensors.
    """
    assert isinstance(model, Transformer), type(model)
    stored_rows = {name: shape[0] for name, shape in parameter_shapes(checkpoint.config).items()}
    canonical = {id(param): name for name, param in model.named_parameters()}  # a tied weight once
    with ExitStack() as stack:
        files = {
            file: stack.enter_context(_StoredFile(file)) for file in sorted(set(checkpoint.files.values()))
        }
        for module in model.modules():
            named = [
                (canonical.pop(id(p)), p) for p in module.parameters(recurse=False) if id(p) in canonical
            ]
            if not named:
                continue
            with gathered([p for _, p in named]) if gathered else nullcontext():
                for name, param in named:
                    source = checkpoint.sources[name]
                    if source.experts:
                        _fill_experts(
                            param, source, {n: files[checkpoint.files[n]] for n in source.expert_names()}
                        )
                    else:
                        _fill(
                            param, name, source, files[checkpoint.files[source.name]], stored_rows[name], seed
                        )
    model.init_buffers()


class _StoredFile:
    """One safetensors file, read two ways: `get_slice` (memory-mapped, any rectangle) and `read_rows` (plain
    reads of a run of whole rows straight into a buffer, in chunks).

    Whole rows of a row-major tensor are one byte range, and reading it with `readinto` was 2-3x faster than
    faulting the same pages of the memory map in (1.24 B bf16 parameters on CPU, 2026-11-26); it is what FSDP's
    Shard(0) blocks and every plain parameter need. The byte offsets are the file's header (safetensors format:
    u64 little-endian header size, JSON header, data), read after `safe_open` has validated it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stack = ExitStack()

    def __enter__(self) -> _StoredFile:
        self.handle = self._stack.enter_context(import_safe_open()(str(self.path), framework="pt"))
        self.raw = self._stack.enter_context(open(self.path, "rb", buffering=0))
        size = int.from_bytes(self.raw.read(8), "little")
        self.header = json.loads(self.raw.read(size))
        self.data_start = 8 + size
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def read_rows(self, name: str, first: int, out: torch.Tensor) -> bool:
        """Rows [first, first + len(out)) of tensor `name` cast into `out`; False when its dtype has no plain
        torch equivalent here (the caller then slices the memory map)."""
        entry = self.header[name]
        dtype = FLOAT_DTYPES.get(entry["dtype"])
        if dtype is None:
            return False
        row_elements = math.prod(entry["shape"][1:])
        row_bytes = row_elements * dtype.itemsize
        rows_per_chunk = max(1, _CHUNK_BYTES // max(1, row_bytes))
        buffer = torch.empty(min(rows_per_chunk, len(out)) * row_bytes, dtype=torch.uint8)
        position = self.data_start + entry["data_offsets"][0] + first * row_bytes
        for start in range(0, len(out), rows_per_chunk):
            count = min(rows_per_chunk, len(out) - start)
            chunk = buffer[: count * row_bytes]
            self._read_exactly(position + start * row_bytes, chunk)
            out[start : start + count].copy_(chunk.view(dtype).view(out[start : start + count].shape))
        return True

    def _read_exactly(self, position: int, into: torch.Tensor) -> None:
        view, done = into.numpy().data, 0
        self.raw.seek(position)
        while done < len(view):
            n = self.raw.readinto(view[done:])
            if not n:
                raise UserInputError(f"{self.path}: ends inside a tensor (was it truncated while loading?)")
            done += n


_CHUNK_BYTES = 32 << 20  # the largest temporary buffer a read uses


def _fill(
    param: torch.Tensor, name: str, source: Source, file: _StoredFile, stored_rows: int, seed: int
) -> None:
    local, shape, runs, cols = _local_layout(param)
    if local.numel() == 0:
        return
    if shape[0] > stored_rows:  # padding rows beyond the checkpoint's vocabulary
        if len(runs) > 1:
            raise NotImplementedError(f"{name}: vocabulary padding rows on a strided (_StridedShard) layout")
        fill_normal(param, INIT_STD, seed=seed, name=name)
    whole_rows = local.ndim == 1 or local.shape[1] == shape[1]
    plain = not source.transposed and not source.rope_heads
    for local_first, first, count in runs:
        last = min(first + count, stored_rows)
        if last <= first:
            continue
        out = local[local_first : local_first + last - first]
        if plain and whole_rows and file.read_rows(source.name, first + source.offset, out):
            continue
        out.copy_(_read_block(file.handle.get_slice(source.name), source, (first, last), cols))


def _fill_experts(param: torch.Tensor, source: Source, files: dict[str, _StoredFile]) -> None:
    """Batched expert weights [E, in, out] from one stored Linear [out, in] per expert (Mixtral): each rank reads
    the experts its rows hold (sharding splits dim 0 only: FSDP's Shard(0), a future expert parallel)."""
    local, shape, runs, _ = _local_layout(param)
    if local.numel() == 0:
        return
    if tuple(local.shape[1:]) != shape[1:]:
        raise NotImplementedError(f"{source.name}: expert weights sharded on a dimension other than 0")
    for local_first, first, count in runs:
        for i in range(count):
            name = source.name.format(expert=first + i)
            local[local_first + i].copy_(files[name].handle.get_slice(name)[:].t())


def _local_layout(
    param: torch.Tensor,
) -> tuple[torch.Tensor, tuple[int, ...], list[tuple[int, int, int]], tuple[int, int] | None]:
    """(local tensor, global shape, runs of rows, column range) of a tensor or a DTensor on this rank.

    A run (local first row, global first row, rows) is a stretch of consecutive global rows: one for a plain
    tensor and for Shard placements; several for FSDP over tensor parallel on the same dimension, whose
    `_StridedShard` gives each rank interleaved blocks. The global indices are torch's own (the function behind
    `compute_local_shape_and_global_offset`), so uneven splits and any mesh of Shard / _StridedShard placements
    come out as DTensor lays them out. Columns must be one range (tensor parallel's Shard(1)).
    """
    from torch.distributed.tensor import DTensor

    shape = tuple(param.shape)
    if not isinstance(param, DTensor):
        return param, shape, [(0, 0, shape[0])], ((0, shape[1]) if param.ndim == 2 else None)
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    mesh, coordinate = param.device_mesh, param.device_mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the parameter's mesh"
    sizes, indices = list(shape), dict[int, Any]()  # global indices of each sharded dim so far (a tensor)
    held: dict[int, list[int]] = {}  # tensor dim → the global indices this rank holds, in local order
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard | _StridedShard):
            dim = placement.dim
            sizes[dim], indices[dim] = _get_shard_size_and_offsets(
                sizes[dim],
                mesh.size(mesh_dim),
                coordinate[mesh_dim],
                placement,
                indices.get(dim),
                shape[dim],
                False,
            )
            held[dim] = indices[dim].tolist()
    local = param.to_local()
    rows = held.get(0, list(range(shape[0])))
    runs: list[tuple[int, int, int]] = []
    for i, row in enumerate(rows[: local.shape[0]]):
        if runs and runs[-1][1] + runs[-1][2] == row:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, row, 1))
    if param.ndim == 1:
        return local, shape, runs, None
    columns = held.get(1, list(range(shape[1])))
    first_col = columns[0] if columns else 0
    if columns != list(range(first_col, first_col + len(columns))):
        raise NotImplementedError("loading into a strided column layout (_StridedShard on dim 1)")
    return local, shape, runs, (first_col, first_col + local.shape[1])


def _read_block(
    stored: Any, source: Source, rows: tuple[int, int], cols: tuple[int, int] | None
) -> torch.Tensor:
    """Our rows [r0, r1) (and columns [c0, c1) of a matrix) of the parameter `source` describes, read from the
    memory-mapped slice `stored` without touching the rest of the tensor."""
    r0, r1 = rows[0] + source.offset, rows[1] + source.offset
    if source.rope_heads:
        # Rows are permuted within each head: read the whole heads that hold [r0, r1), reorder, cut.
        head_dim = stored.get_shape()[0] // source.rope_heads
        h0, h1 = r0 // head_dim, math.ceil(r1 / head_dim)
        span = (slice(h0 * head_dim, h1 * head_dim),) + ((slice(*cols),) if cols else ())
        heads = permute_rope_rows(stored[span], h1 - h0, to_hf=False)
        return heads[r0 - h0 * head_dim : r1 - h0 * head_dim]
    if cols is None:
        return stored[r0:r1]
    if source.transposed:  # Conv1D [in, out]: our (row, col) is its (col, row)
        return stored[cols[0] : cols[1], r0:r1].t()
    return stored[r0:r1, cols[0] : cols[1]]
