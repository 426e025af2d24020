"""`gaudi3 prepare`: text in, verified token shards + manifest out."""

from __future__ import annotations

from collections.abc import Sequence

import click

from gaudi3_scale.config.core import from_dict
from gaudi3_scale.data import DataConfig, prepare_dataset

__all__ = ["run_prepare"]


def run_prepare(
    sources: Sequence[str],
    *,
    tokenizer: str,
    vocab_size: int | None,
    val_fraction: float,
    seed: int,
    shard_mb: float,
    text_field: str,
    out_dir: str | None,
    workers: int,
    force: bool,
) -> None:
    fields = {"tokenizer": tokenizer, "vocab_size": vocab_size, "val_fraction": val_fraction}
    fields |= {
        "source": ",".join(sources),
        "split_seed": seed,
        "shard_mb": shard_mb,
        "text_field": text_field,
        "prepared_dir": out_dir,
        "prepare_workers": workers,
    }
    cfg = from_dict(DataConfig, fields, prefix="data")
    click.echo(str(prepare_dataset(cfg, force=force)))
