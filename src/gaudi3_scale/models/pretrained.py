"""Pretrained weights into a model laid out any way (`model.init_from`, serving an export).

A checkpoint directory is a Hugging Face one (`config.json` + `model.safetensors`, or shards listed in
`model.safetensors.index.json`; Llama or GPT-2) or a `gaudi3 ckpt export` one (`--format safetensors`:
`model_config.json` + our names; `--format hf` is a Hugging Face Llama directory). `open_pretrained` checks it —
configs, every shard present and readable, every tensor there with the right shape — reading only headers;
`load_pretrained(model, checkpoint)` fills a model built from that config, after `to_empty`.

Each rank reads only what it holds. For every parameter (a plain tensor, or a DTensor with any Shard placements
over a 1-D or 2-D mesh: FSDP's Shard(0), tensor parallel's Shard(0) / Shard(1), FSDP over tensor parallel's
_StridedShard) we compute which global rows and columns the local block holds and read those rectangles with safetensors' `get_slice`, which slices the memory-mapped file:
no rank materialises a whole tensor it does not hold. Why not DCP's `HuggingFaceStorageReader` (in torch 2.13)? It
loads tensors in their stored names and shapes, so HF's rotate-half wq / wk rows and GPT-2's transposed, fused
`c_attn` would land on the wrong ranks and need a redistribution; with `Source` (models.hf) we map our rectangle to
the stored one instead (whole heads for the RoPE rows, swapped indices for Conv1D, an offset into c_attn) and read
it directly. Values are cast to the parameter's dtype (checkpoints are often bf16; parameters fp32).

Rows the checkpoint does not have — vocabulary padding beyond its vocab (`model.pad_vocab_to_multiple`) — get the
normal init (`models.common.init.fill_normal`, layout-independent); rows the model does not have (a shorter
`context_length` than GPT-2's position table) are not read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gaudi3_scale.config.core import from_dict
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.config.files import load_json_file
from gaudi3_scale.models.common.init import fill_normal
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.hf import Source, hf_model_config, hf_sources, permute_rope_rows, stored_shapes
from gaudi3_scale.models.transformer import INIT_STD, Transformer

__all__ = [
    "HF_CONFIG_NAME",
    "INDEX_NAME",
    "MODEL_CONFIG_NAME",
    "SHAPE_FIELDS",
    "WEIGHTS_NAME",
    "PretrainedCheckpoint",
    "load_pretrained",
    "open_pretrained",
    "pretrained_model_fields",
    "read_pretrained_config",
    "tokenizer_beside",
]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"  # sharded: {"weight_map": {tensor name: shard file}}
MODEL_CONFIG_NAME = "model_config.json"  # `gaudi3 ckpt export --format safetensors`: our ModelConfig
HF_CONFIG_NAME = "config.json"  # Hugging Face (and `gaudi3 ckpt export --format hf`)
_INSTALL = "pip install 'gaudi3-scale[export]'"


@dataclass(frozen=True)
class PretrainedCheckpoint:
    """A checked checkpoint directory: its model shape, format and where each tensor is."""

    directory: Path
    config: ModelConfig  # the checkpoint's shape (vocab = its embedding rows)
    model_type: str  # "llama" / "gpt2" (Hugging Face names) or "gaudi3" (ours)
    files: dict[str, Path] = field(repr=False)  # stored tensor name → file
    sources: dict[str, Source] = field(repr=False)  # our parameter name → where it is stored


def tokenizer_beside(directory: str | Path) -> Path | None:
    """The tokenizer.json beside a checkpoint's weights: Hugging Face's at the top, else our export's tokenizer/."""
    for path in (Path(directory) / "tokenizer.json", Path(directory) / "tokenizer" / "tokenizer.json"):
        if path.is_file():
            return path
    return None


def open_pretrained(directory: str | Path, *, field_name: str = "model.init_from") -> PretrainedCheckpoint:
    """Check `directory` and describe it; one line naming `field_name`, the path and what is wrong otherwise.

    Reads the config and each safetensors header (not the weights).
    """
    path = Path(directory)
    config, model_type = read_pretrained_config(path, field_name=field_name)
    files = _tensor_files(path, field_name)
    # GPT-2 names start with `transformer.` as transformers saves them; not in the original OpenAI conversion.
    prefix = "transformer." if model_type == "gpt2" and "wte.weight" not in files else ""
    if model_type == "gaudi3":
        sources = {name: Source(name) for name in _our_shapes(config)}
        expected = _our_shapes(config)
    else:
        sources = hf_sources(config, model_type, prefix=prefix)
        expected = stored_shapes(config, model_type, prefix=prefix)
    _check_tensors(path, files, expected, field_name)
    return PretrainedCheckpoint(path, config, model_type, files, sources)


def read_pretrained_config(
    directory: str | Path, *, field_name: str = "model.init_from"
) -> tuple[ModelConfig, str]:
    """The checkpoint's `ModelConfig` and model type ("llama", "gpt2" or "gaudi3"), from its config file only."""
    path = Path(directory)
    if not path.is_dir():
        raise UserInputError(
            f"{field_name}: {str(path)!r} is not a directory; allowed: a Hugging Face checkpoint directory "
            "(config.json + *.safetensors) or one written by `gaudi3 ckpt export`"
        )
    if (path / MODEL_CONFIG_NAME).is_file():
        raw = load_json_file(path / MODEL_CONFIG_NAME, what=f"{field_name} model config")
        try:
            return from_dict(ModelConfig, raw), "gaudi3"
        except UserInputError as exc:
            raise UserInputError(f"{field_name} {path / MODEL_CONFIG_NAME}: {exc}") from None
    if (path / HF_CONFIG_NAME).is_file():
        raw = load_json_file(path / HF_CONFIG_NAME, what=f"{field_name} config")
        config = hf_model_config(raw, name=path.name, where=f"{field_name} {path / HF_CONFIG_NAME}")
        return config, config.arch
    raise UserInputError(
        f"{field_name}: {str(path)!r} has neither config.json (Hugging Face) nor model_config.json "
        "(`gaudi3 ckpt export`); allowed: a directory holding one of them beside its safetensors"
    )


# What the checkpoint decides; the rest of the model section (name, dropout, vocabulary padding) is the run's.
SHAPE_FIELDS = ("arch", "num_layers", "num_heads", "num_kv_heads", "activation", "dim", "ffn_dim", "vocab_size",
                "bias", "norm_eps", "rope_theta", "tie_embeddings")  # fmt: skip


def pretrained_model_fields(init_from: str, explicit: Mapping[str, Any]) -> dict[str, Any]:
    """The model fields `model.init_from` decides: its config's shape, and its context_length unless `explicit`
    (the fields the user set) asks for a shorter one. A set field that disagrees is one line (`ConfigError`).

    A longer context than the checkpoint's is refused: GPT-2 has no learned positions beyond it, and Llama's RoPE
    was not trained there (scaled RoPE is not implemented).
    """
    config, _ = read_pretrained_config(init_from)
    fields = {name: getattr(config, name) for name in SHAPE_FIELDS}
    # Compare what the model computes with: num_kv_heads null means num_heads, ffn_dim null means 4 * dim.
    effective = {"num_kv_heads": lambda v: v or config.num_heads, "ffn_dim": lambda v: v or 4 * config.dim}
    wanted = {"num_kv_heads": config.kv_heads, "ffn_dim": config.hidden_dim}
    for name in SHAPE_FIELDS:
        if name not in explicit or (name == "activation" and config.arch != "gpt2"):
            continue
        value = effective.get(name, lambda v: v)(explicit[name])
        if value != wanted.get(name, fields[name]):
            raise ConfigError(
                f"model.{name}",
                f"{explicit[name]!r} disagrees with model.init_from {init_from} ({fields[name]!r}); leave it unset",
            )
    context = explicit.get("context_length", config.context_length)
    if isinstance(context, int) and context > config.context_length:
        raise ConfigError(
            "model.context_length",
            f"{context} exceeds model.init_from {init_from}'s {config.context_length} positions; allowed: at most "
            f"{config.context_length}, or unset",
        )
    return {**fields, "context_length": context}


def _our_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in Transformer(cfg).named_parameters()}


def _tensor_files(directory: Path, field_name: str) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it (the index's weight map, or the single file's keys)."""
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        index = load_json_file(index_path, what=f"{field_name} safetensors index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserInputError(
                f"{field_name}: {index_path} has no weight_map of tensor name → file; allowed: the index "
                "transformers' save_pretrained writes"
            )
        files = {name: directory / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file() or file.parent.resolve() != directory.resolve():
                raise UserInputError(
                    f"{field_name}: {index_path} lists shard {file.name!r}, which is missing from {directory}; "
                    "allowed: an index whose every shard file is present"
                )
        return files
    single = directory / WEIGHTS_NAME
    if not single.is_file():
        raise UserInputError(
            f"{field_name}: {str(directory)!r} has neither {WEIGHTS_NAME} nor {INDEX_NAME}; allowed: one "
            "safetensors file, or shards listed by an index"
        )
    return dict.fromkeys(_header(single, field_name), single)


def _header(path: Path, field_name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name → (dtype, shape) from a safetensors header; one line for a file that is not one."""
    safe_open = _safe_open()
    import safetensors

    try:
        with safe_open(str(path), framework="pt") as handle:
            out = {}
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                sliced = handle.get_slice(name)
                out[name] = (sliced.get_dtype(), tuple(sliced.get_shape()))
            return out
    except (safetensors.SafetensorError, OSError, ValueError) as exc:  # truncated, garbage header
        raise UserInputError(
            f"{field_name}: {path} is not a readable safetensors file ({str(exc).splitlines()[0]}); allowed: a "
            "complete file as save_pretrained or `gaudi3 ckpt export` writes it"
        ) from None


def _check_tensors(
    directory: Path, files: dict[str, Path], expected: dict[str, tuple[int, ...]], field_name: str
) -> None:
    """Every tensor the model needs is in the file the index names, with the shape its config implies."""
    headers = {file: _header(file, field_name) for file in sorted(set(files.values()))}
    for name, shape in expected.items():
        file = files.get(name)
        if file is None or name not in headers[file]:
            where = file.name if file is not None else "any file"
            raise UserInputError(
                f"{field_name}: tensor {name!r} is missing from {where} in {directory}; allowed: a checkpoint "
                "holding every weight of its config's model"
            )
        stored = headers[file][name][1]
        if stored != shape:
            raise UserInputError(
                f"{field_name}: tensor {name!r} in {file} has shape {list(stored)}, but the checkpoint's config "
                f"implies {list(shape)}; allowed: weights that match their config"
            )


@torch.no_grad()
def load_pretrained(model: nn.Module, checkpoint: PretrainedCheckpoint, *, seed: int = 0) -> None:
    """Fill every parameter of `model` (a `Transformer` after `to_empty`, plain or sharded) from `checkpoint`, each
    rank reading only its blocks, and rebuild the non-persistent buffers (the RoPE cache).

    `seed` is for rows the checkpoint does not have (vocabulary padding): they get the normal init of that seed.
    """
    assert isinstance(model, Transformer), type(model)
    stored_rows = {name: shape[0] for name, shape in _our_shapes(checkpoint.config).items()}
    with ExitStack() as stack:
        files = {
            file: stack.enter_context(_StoredFile(file)) for file in sorted(set(checkpoint.files.values()))
        }
        for name, param in model.named_parameters():
            source = checkpoint.sources[name]
            _fill(param, name, source, files[checkpoint.files[source.name]], stored_rows[name], seed)
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
        self.handle = self._stack.enter_context(_safe_open()(str(self.path), framework="pt"))
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
        dtype = _DTYPES.get(entry["dtype"])
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


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
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


def iter_checkpoint_tensors(checkpoint: PretrainedCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stored tensor, whole (for a tool that needs the bytes, e.g. the load benchmark's read-once)."""
    safe_open = _safe_open()
    by_file: dict[Path, list[str]] = {}
    for name, file in checkpoint.files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        with safe_open(str(file), framework="pt") as handle:
            for name in names:
                yield name, handle.get_tensor(name)


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError:
        raise UserInputError(
            f"reading safetensors checkpoints needs the safetensors package: {_INSTALL}"
        ) from None
    return safe_open
