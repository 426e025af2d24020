"""Where training tokens come from and how they are made."""

from __future__ import annotations

from dataclasses import dataclass, field

from gaudi3_scale.config.core import check_positive, check_range
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.config.numbers import INT32_MAX, check_number, check_seed
from gaudi3_scale.data.sources import DEFAULT_SYNTHETIC_VOCAB, synthetic_vocab

__all__ = ["DataConfig"]


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
        default=0.1, metadata={"help": "fraction of each source's tokens held out for validation"}
    )
    split_seed: int = field(
        default=0,
        metadata={"help": "seed of the train/val split, and of synthetic ids (recorded in the manifest)"},
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
    prepare_workers: int = field(default=1, metadata={"help": "tokenizer worker processes used by prepare"})
    loader_workers: int = field(default=0, metadata={"help": "DataLoader worker processes per rank"})

    def __post_init__(self) -> None:
        check_range("val_fraction", self.val_fraction, 0.0, 0.5)
        check_positive("vocab_size", self.vocab_size)
        check_number("prepare_workers", self.prepare_workers, low=1, high=INT32_MAX)  # process counts: C ints
        check_number("loader_workers", self.loader_workers, low=0, high=INT32_MAX)
        check_seed("split_seed", self.split_seed)
        check_positive("synthetic_tokens", self.synthetic_tokens)
        vocab = synthetic_vocab(self.source)
        if vocab is not None and self.vocab_size not in (None, vocab):
            raise ConfigError(
                "vocab_size",
                f"data.source={self.source} has {vocab} ids; set it to null, or the source to "
                f"synthetic:{self.vocab_size}",
            )
