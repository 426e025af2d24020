"""Where training tokens come from and how they are made."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from gaudi3_scale.config.core import check_field_types, check_positive, check_range
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.config.numbers import INT32_MAX, check_number, check_seed
from gaudi3_scale.data.sources import DEFAULT_SYNTHETIC_VOCAB, synthetic_vocab

__all__ = ["DataConfig", "MixtureSource", "weight_sum_problem"]


@dataclass(kw_only=True)
class MixtureSource:
    """One member of `data.mixture`: a source (any `data.source` form, or a prepared dataset's fsspec URL) and its
    sampling weight (weights are relative: 7, 2, 1 is 70 % / 20 % / 10 %)."""

    source: str = field(metadata={"help": "a data.source value or the URL of a prepared dataset"})
    weight: float = field(metadata={"help": "relative sampling weight, >= 0"})
    name: str | None = field(
        default=None, metadata={"help": "label in logs and the sampler state; null = derived from source"}
    )

    def __post_init__(self) -> None:
        check_number("weight", self.weight, low=0.0)

    @property
    def label(self) -> str:
        """`name`, or by default the last part of `source` (`s3://b/web` -> `web`)."""
        if self.name:
            return self.name
        return os.path.basename(self.source.rstrip("/")) or self.source


@dataclass(kw_only=True)
class DataConfig:
    source: str = field(
        default="tinyshakespeare",
        metadata={
            "help": "bundled corpus name, a text file / glob / directory, hf:NAME (several: comma-separated), "
            "a directory made by `gaudi3 prepare`, or synthetic[:VOCAB]: uniformly random ids in [0, VOCAB) "
            f"(default VOCAB {DEFAULT_SYNTHETIC_VOCAB}, GPT-2's; data.tokenizer does not apply)"
        },
    )
    tokenizer: str = field(
        default="char", metadata={"help": "char, byte, bpe, or a path to a tokenizer.json"}
    )
    vocab_size: int | None = field(
        default=None, metadata={"help": "vocabulary size to train for tokenizer=bpe"}
    )
    val_fraction: float = field(
        default=0.1, metadata={"help": "fraction of each shard's tokens held out for validation (its tail)"}
    )
    split_seed: int = field(
        default=0,
        metadata={"help": "seed of synthetic ids (recorded in the manifest; the text split needs none)"},
    )
    synthetic_tokens: int = field(
        default=2_000_000,
        metadata={
            "help": "tokens of the synthetic train split; val adds val_fraction of the total (source=synthetic)"
        },
    )
    prepared_dir: str | None = field(
        default=None,
        metadata={"help": "where prepared shards go; null = a cache directory keyed by source + tokenizer"},
    )
    shard_mb: float = field(
        default=64.0,
        metadata={
            "help": "source text per prepared shard, MiB (a shard holds that text's tokens; prepare's unit "
            "of parallel work and of streaming)"
        },
    )
    text_field: str = field(default="text", metadata={"help": "the text column of JSONL / Parquet sources"})
    mixture: list[MixtureSource] | None = field(
        default=None,
        metadata={
            "help": "several datasets sampled by weight, e.g. [{source: web, weight: 7}, {source: "
            "s3://b/code, weight: 3}]; replaces data.source. All must share one tokenizer"
        },
    )
    cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "local shard cache of a dataset at an fsspec URL; null = <cache>/shards/<URL hash>"
        },
    )
    cache_limit_gib: float = field(
        default=16.0, metadata={"help": "most GiB the shard cache of one URL dataset keeps on local disk"}
    )
    prefetch_shards: int = field(
        default=2, metadata={"help": "shards of a URL dataset fetched ahead of the sampler"}
    )
    fetch_retry_s: float = field(
        default=300.0,
        metadata={
            "help": "how long a shard fetch keeps retrying (exponential backoff) before training stops"
        },
    )
    shuffle_block_shards: int | None = field(
        default=None,
        metadata={
            "help": "shards whose windows are shuffled together (the epoch's shard order is shuffled "
            "too); null = all shards of a local dataset, as many as fit half the cache for a URL"
        },
    )
    prepare_workers: int = field(
        default=1, metadata={"help": "worker processes of prepare (each reads, tokenizes and writes a shard)"}
    )
    loader_workers: int = field(default=0, metadata={"help": "DataLoader worker processes per rank"})
    mlm_mask_rate: float = field(
        default=0.15,
        metadata={
            "help": "model.arch bert: fraction of each window's tokens the masked-language-model loss predicts "
            "(80 % shown as [MASK], 10 % random, 10 % unchanged; Devlin et al. 2018 use 0.15)"
        },
    )

    @property
    def cache_limit_bytes(self) -> int:
        """`cache_limit_gib` in bytes (rounded down: the cache never holds more than the limit)."""
        return int(self.cache_limit_gib * (1 << 30))

    def __post_init__(self) -> None:
        check_field_types(self)  # as from YAML; a path (`source=Path(...)`) is taken as its text
        check_range("val_fraction", self.val_fraction, 0.0, 0.5)
        check_positive("vocab_size", self.vocab_size)
        check_number("prepare_workers", self.prepare_workers, low=1, high=INT32_MAX)  # process counts: C ints
        check_number("loader_workers", self.loader_workers, low=0, high=INT32_MAX)
        check_seed("split_seed", self.split_seed)
        check_positive("synthetic_tokens", self.synthetic_tokens)
        check_number("shard_mb", self.shard_mb, low=1e-5)
        check_number("cache_limit_gib", self.cache_limit_gib, low=1e-6)
        check_number("prefetch_shards", self.prefetch_shards, low=0, high=INT32_MAX)
        check_number("fetch_retry_s", self.fetch_retry_s, low=0.0)
        check_positive("shuffle_block_shards", self.shuffle_block_shards)
        check_number("mlm_mask_rate", self.mlm_mask_rate)
        if not 0 < self.mlm_mask_rate < 1:
            raise ConfigError(
                "mlm_mask_rate",
                f"must be between 0 and 1, both excluded (e.g. 0.15), got {self.mlm_mask_rate}",
            )
        if not self.text_field:
            raise ConfigError("text_field", "must name a column, e.g. text")
        if self.mixture is not None:
            _check_mixture(self.mixture)
        vocab = synthetic_vocab(self.source)
        if vocab is not None and self.vocab_size not in (None, vocab):
            raise ConfigError(
                "vocab_size",
                f"data.source={self.source} has {vocab} ids; set it to null, or the source to "
                f"synthetic:{self.vocab_size}",
            )


def _check_mixture(mixture: list[MixtureSource]) -> None:
    if not mixture:
        raise ConfigError("mixture", "is empty; list at least one {source, weight}, or set it to null")
    if problem := weight_sum_problem([m.weight for m in mixture]):
        raise ConfigError("mixture", problem)
    names = [m.name or m.source for m in mixture]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError("mixture", f"{', '.join(duplicates)} listed twice; give each member its own name")
    labels = [m.label for m in mixture]
    for label in labels:
        clash = [m.source for m in mixture if m.label == label]
        if len(clash) > 1:
            raise ConfigError(
                "mixture",
                f"members {', '.join(repr(c) for c in clash)} both get the name {label!r} (the last part of their "
                "source); give each its own name, e.g. {source: ..., weight: ..., name: " + f"{label}2}}",
            )


def weight_sum_problem(weights: Sequence[float]) -> str | None:
    """Why relative sampling weights (finite, >= 0) cannot be normalised: they sum to 0, or past the largest float."""
    total = sum(weights)  # inf past the largest float (math.fsum would raise OverflowError)
    if math.isinf(total):
        return (
            f"the weights sum past the largest float ({sys.float_info.max:.2g}); weights are relative (7, 2, 1 is "
            "70 % / 20 % / 10 %): scale them down"
        )
    if not total > 0:
        return f"weights sum to {total:g}; they must sum to a positive number"
    return None
