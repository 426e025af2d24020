"""Open a prepared dataset: verified, read-only token memmaps plus its manifest and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from gaudi3_scale.data.manifest import Manifest, numpy_dtype, verify_prepared
from gaudi3_scale.data.tokenizers import Tokenizer, load_tokenizer

__all__ = ["PreparedData", "load_prepared"]


@dataclass(frozen=True)
class PreparedData:
    directory: Path
    manifest: Manifest
    train: np.ndarray  # read-only np.memmap (a plain empty array when the split has no tokens)
    val: np.ndarray

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """Loaded on first use: training never needs it, sampling text does."""
        return load_tokenizer(self.directory)


def _open_split(directory: Path, manifest: Manifest, split: str) -> np.ndarray:
    shard = manifest.shard(split)
    dtype = numpy_dtype(manifest.dtype)
    if shard.num_tokens == 0:  # mmap cannot map an empty file
        empty = np.empty(0, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(directory / shard.file, dtype=dtype, mode="r", shape=(shard.num_tokens,))


def load_prepared(directory: Path | str, *, verify_checksums: bool = True) -> PreparedData:
    """Open a directory made by `prepare_dataset`; shard sizes are always checked, SHA-256 unless told not to."""
    directory = Path(directory)
    manifest = verify_prepared(directory, checksums=verify_checksums)
    return PreparedData(
        directory=directory,
        manifest=manifest,
        train=_open_split(directory, manifest, "train"),
        val=_open_split(directory, manifest, "val"),
    )
