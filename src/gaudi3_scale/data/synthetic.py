"""``data.source: synthetic[:VOCAB]``: uniformly random token ids, for benchmarks that must not depend on a corpus.

Prepare writes them straight into one shard per split, ``train-00000.bin`` / ``val-00000.bin``, with the usual manifest (so sampling, validation,
checkpoints and resume work as with any corpus) and saves a `SyntheticTokenizer` beside them; nothing is read or
downloaded. Sizes follow the text split rule: train holds ``data.synthetic_tokens`` ids and val holds
``val_fraction`` of the total, as the last ``val_fraction`` of a text document would.

Ids are drawn by numpy's default generator (PCG64) in blocks of `BLOCK_TOKENS`: block b of split s (train 0,
val 1) comes from ``default_rng([split_seed, s, b])``, so a larger dataset starts with the ids of a smaller one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gaudi3_scale.data.encode import write_shard
from gaudi3_scale.data.manifest import FORMAT_VERSION, SPLITS, Shard, numpy_dtype, shard_file, token_dtype
from gaudi3_scale.data.tokenizers import SyntheticTokenizer

if TYPE_CHECKING:
    from gaudi3_scale.data.config import DataConfig

__all__ = [
    "BLOCK_TOKENS",
    "SYNTHETIC_SPLIT_RULE",
    "synthetic_settings",
    "synthetic_split_sizes",
    "write_synthetic_splits",
]

# 4 Mi ids (8 MiB as uint16) per draw: memory stays bounded whatever synthetic_tokens is.
BLOCK_TOKENS = 1 << 22
SYNTHETIC_SPLIT_RULE = (
    "synthetic: uniform ids in [0, vocab_size); train = synthetic_tokens ids, val = val_fraction of the total; "
    "block b of split s (train 0, val 1) drawn from numpy default_rng([split_seed, s, b])"
)


def synthetic_split_sizes(train_tokens: int, val_fraction: float) -> dict[str, int]:
    """Tokens per split: val / (train + val) = val_fraction, as for a text document."""
    # DataConfig keeps val_fraction <= 0.5, so the divisor is never 0.
    return {"train": train_tokens, "val": round(train_tokens * val_fraction / (1 - val_fraction))}


def synthetic_settings(cfg: DataConfig, vocab_size: int) -> dict[str, Any]:
    """Everything that changes the output; prepare compares it to decide whether a re-run is a no-op."""
    return {
        "source": f"synthetic:{vocab_size}",
        "tokenizer": SyntheticTokenizer.kind,
        "vocab_size": vocab_size,
        "synthetic_tokens": cfg.synthetic_tokens,
        "val_fraction": cfg.val_fraction,
        "split_seed": cfg.split_seed,
        # NumPy keeps Generator streams only within a version (NEP 19), so an upgrade regenerates the ids.
        "generator": f"numpy {np.__version__} PCG64",
        "block_tokens": BLOCK_TOKENS,
        "format_version": FORMAT_VERSION,
    }


def write_synthetic_splits(directory: Path, vocab_size: int, sizes: dict[str, int], seed: int) -> list[Shard]:
    """Write ``train-00000.bin`` and ``val-00000.bin`` of random ids into `directory`; `sizes` from
    `synthetic_split_sizes`."""
    dtype = numpy_dtype(token_dtype(vocab_size))
    return [
        write_shard(
            directory / shard_file(split, 0),
            split,
            _random_ids(vocab_size, sizes[split], dtype, [seed, index]),
        )
        for index, split in enumerate(SPLITS)
    ]


def _random_ids(
    vocab_size: int, num_tokens: int, dtype: np.dtype[Any], key: list[int]
) -> Iterator[np.ndarray]:
    for block, start in enumerate(range(0, num_tokens, BLOCK_TOKENS)):
        rng = np.random.default_rng([*key, block])
        size = min(BLOCK_TOKENS, num_tokens - start)
        # Drawn in the native integer type, stored little-endian like every shard (a no-op on x86 and ARM).
        yield rng.integers(0, vocab_size, size=size, dtype=dtype.type).astype(dtype, copy=False)
