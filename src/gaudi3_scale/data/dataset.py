"""Open a prepared dataset: verified, read-only token memmaps (one per shard) plus its manifest and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data.manifest import Manifest, Shard, numpy_dtype, verify_prepared
from gaudi3_scale.data.tokenizers import Tokenizer, load_tokenizer

__all__ = ["PreparedData", "load_prepared"]


@dataclass(frozen=True)
class PreparedData:
    directory: Path
    manifest: Manifest
    # One read-only np.memmap per shard, in stream order (a plain empty array for a shard of 0 tokens).
    train_shards: list[np.ndarray]
    val_shards: list[np.ndarray]

    @property
    def train(self) -> np.ndarray:
        """The train tokens of a single-shard dataset (the loader reads `train_shards` for several)."""
        return self._only_shard("train", self.train_shards)

    @property
    def val(self) -> np.ndarray:
        return self._only_shard("val", self.val_shards)

    def _only_shard(self, split: str, shards: list[np.ndarray]) -> np.ndarray:
        if len(shards) != 1:
            raise UserInputError(
                f"{self.directory}: the {split} split has {len(shards)} shards and this reader takes a "
                f"single-shard dataset (one source file of at most data.shard_mb); use PreparedData.{split}_shards"
            )
        return shards[0]

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """Loaded on first use: training never needs it, sampling text does."""
        return load_tokenizer(self.directory)


def _open_shard(directory: Path, manifest: Manifest, shard: Shard) -> np.ndarray:
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
        train_shards=[_open_shard(directory, manifest, s) for s in manifest.shards_of("train")],
        val_shards=[_open_shard(directory, manifest, s) for s in manifest.shards_of("val")],
    )
