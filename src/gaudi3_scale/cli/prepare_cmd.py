"""`gaudi3 prepare`: text in, verified token shards + manifest out (in a directory, or published to a URL)."""

from __future__ import annotations

from collections.abc import Sequence

import click

from gaudi3_scale.config.core import from_dict
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.data import DataConfig, prepare_dataset
from gaudi3_scale.data.publish import check_publish_target, publish_prepared
from gaudi3_scale.data.remote import is_url

__all__ = ["run_prepare"]

# The data config's fields as this verb's flags, so that a refusal names what was typed.
_FLAGS = {
    "source": "SOURCES",
    "tokenizer": "--tokenizer",
    "vocab_size": "--vocab-size",
    "val_fraction": "--val-fraction",
    "split_seed": "--seed",
    "shard_mb": "--shard-mb",
    "text_field": "--text-field",
    "prepared_dir": "--out",
    "prepare_workers": "--workers",
}


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
    url = out_dir if out_dir is not None and is_url(out_dir) else None
    fields |= {
        "source": ",".join(sources),
        "split_seed": seed,
        "shard_mb": shard_mb,
        "text_field": text_field,
        "prepared_dir": None if url else out_dir,  # a URL: prepared in the cache directory, then published
        "prepare_workers": workers,
    }
    try:
        cfg = from_dict(DataConfig, fields, prefix="data")
        if url:
            check_publish_target(url, field="--out")
        local = prepare_dataset(cfg, force=force)
    except ConfigError as exc:
        field = exc.field.removeprefix("data.")
        flag = _FLAGS.get(field)
        if flag is None or (field == "prepared_dir" and fields["prepared_dir"] is None):
            raise  # not a flag's (the cache directory, when --out is absent or a URL): the field's own name
        raise ConfigError(flag, exc.problem) from None
    click.echo(publish_prepared(local, url, field="--out") if url else str(local))
