"""What a run trains on: one prepared dataset, local or at an fsspec URL, or a weighted mixture of several.

`open_training_data(cfg)` resolves `data.source` / `data.prepared_dir` / `data.mixture` into `TrainingData`: per
member its manifest, its train and val splits as `ShardedTokens` (local memmaps, or shards fetched into a bounded
local cache by `data.remote`), its weight and its shuffle block (`data.shuffle_block_shards`). A source that is
not yet prepared is prepared first (`prepare_dataset`); with `data.prepared_dir` set to a URL the prepared
directory is then published there (`data.publish`) and read back through the cache like any URL dataset.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.data.config import DataConfig
from gaudi3_scale.data.manifest import Manifest, Shard, numpy_dtype, tokens_sha256, verify_prepared
from gaudi3_scale.data.shards import LocalShardOpener, ShardedTokens
from gaudi3_scale.data.tokenizers import Tokenizer, load_tokenizer

__all__ = [
    "MIXTURE_SHA256_PREFIX",
    "DatasetMember",
    "TrainingData",
    "open_training_data",
    "remote_block_shards",
    "require_block_room",
    "training_data_from_dir",
]

MIXTURE_SHA256_PREFIX = "mixture:"  # a mixture's tokens_sha256, told apart from one dataset's by a resume


@dataclass(kw_only=True)
class DatasetMember:
    name: str
    weight: float
    manifest: Manifest
    directory: Path  # the prepared directory, or the URL dataset's local cache (manifest + tokenizer)
    train: ShardedTokens
    val: ShardedTokens
    block_shards: int  # resolved data.shuffle_block_shards
    block_auto: bool = True  # data.shuffle_block_shards was null: a resume takes the checkpoint's
    url: str | None = None
    cache_limit_bytes: int = 0  # a URL member's data.cache_limit_gib, in bytes

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size


@dataclass(kw_only=True)
class TrainingData:
    members: list[DatasetMember]

    @property
    def vocab_size(self) -> int:
        return self.members[0].vocab_size

    @property
    def is_mixture(self) -> bool:
        return len(self.members) > 1

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.members[0].directory)

    @property
    def tokens_sha256(self) -> str:
        """The identity of what is trained on (checkpoints record it): one dataset's `tokens_sha256`, or, for a
        mixture, `MIXTURE_SHA256_PREFIX` and a hash over each member's name and `tokens_sha256`, in name order.
        Weights and order are not in it: the mixture sampler's state checks those and says so (equal fractions
        resume), while this says that a member's data, or the set of members, changed."""
        if not self.is_mixture:
            return tokens_sha256(self.members[0].manifest)
        parts = sorted([m.name, tokens_sha256(m.manifest)] for m in self.members)
        return MIXTURE_SHA256_PREFIX + hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def stats(self) -> dict[str, float]:
        """Shard-cache counters of the URL members (bytes fetched, hits, waits, retries), summed."""
        total: dict[str, float] = {}
        for member in self.members:
            opener = member.train.opener
            stats = getattr(opener, "stats", None)
            for key, value in (stats() if stats is not None else {}).items():
                total[key] = total.get(key, 0) + value
        return total


def _split_tokens(manifest: Manifest, split: str, opener_for: Any) -> ShardedTokens:
    shards = manifest.shards_of(split)
    counts = [s.num_tokens for s in shards]
    opener = opener_for(shards, counts)
    return ShardedTokens(
        counts, opener, dtype=numpy_dtype(manifest.dtype), prefetch=getattr(opener, "prefetch", None)
    )


def training_data_from_dir(
    directory: Path, *, name: str = "data", weight: float = 1.0, block_shards: int | None = None
) -> DatasetMember:
    """A local prepared directory (sizes and SHA-256 checked, its tokenizer within the manifest's vocabulary) as a
    member."""
    manifest = verify_prepared(directory, checksums=True)
    _check_tokenizer_ids(directory, manifest, where=str(directory), fix="re-run `gaudi3 prepare --force`")

    def local(shards: list[Shard], counts: list[int]) -> LocalShardOpener:
        return LocalShardOpener([directory / s.file for s in shards], counts, numpy_dtype(manifest.dtype))

    train = _split_tokens(manifest, "train", local)
    return DatasetMember(
        name=name,
        weight=weight,
        manifest=manifest,
        directory=directory,
        train=train,
        val=_split_tokens(manifest, "val", local),
        block_shards=min(block_shards or len(train.shard_tokens), len(train.shard_tokens)),
        block_auto=block_shards is None,
    )


def _check_tokenizer_ids(directory: Path, manifest: Manifest, *, where: str, fix: str) -> None:
    """The tokenizer in `directory` (a prepared directory, or a URL dataset's cache) makes no id past the manifest's
    vocab_size: those would index past the model's embedding rows, an IndexError mid-training."""
    tokenizer_ids = load_tokenizer(directory).vocab_size
    if tokenizer_ids > manifest.vocab_size:
        raise UserInputError(
            f"{where}: its tokenizer has {tokenizer_ids} ids but the manifest's vocab_size is "
            f"{manifest.vocab_size}; {fix}"
        )


def _remote_member(cfg: DataConfig, url: str, *, name: str, weight: float, field: str) -> DatasetMember:
    from gaudi3_scale.data.remote_shards import RemoteShardOpener, remote_settings

    settings = remote_settings(cfg, url, field=field)
    probe = RemoteShardOpener.handle(
        url, settings
    )  # opens (fails fast, one line) and shares the cache handle
    manifest = probe.manifest
    _check_tokenizer_ids(probe.directory, manifest, where=url,
                         fix="re-run `gaudi3 prepare --force` and publish it again")  # fmt: skip

    def remote(shards: list[Shard], counts: list[int]) -> RemoteShardOpener:
        return RemoteShardOpener(url, settings, shards, numpy_dtype(manifest.dtype))

    train = _split_tokens(manifest, "train", remote)
    return DatasetMember(
        name=name,
        weight=weight,
        manifest=manifest,
        directory=probe.directory,
        train=train,
        val=_split_tokens(manifest, "val", remote),
        block_shards=remote_block_shards(cfg, manifest, url),
        block_auto=cfg.shuffle_block_shards is None,
        url=url,
        cache_limit_bytes=cfg.cache_limit_bytes,
    )


def remote_block_shards(cfg: DataConfig, manifest: Manifest, url: str) -> int:
    """`data.shuffle_block_shards` of a dataset read through the shard cache: as set, or by default as many shards as
    let the block in use and the next one, the prefetch depth and one val shard fit the cache (at least 1); at
    most the train shards. A cache that cannot hold one block is refused with one line: the windows of a block
    are shuffled together, so every step reads from all of its shards."""
    from gaudi3_scale.data.remote import require_cache_room

    largest = max([s.size_bytes for s in manifest.shards] + [1])
    fit = max(1, (cfg.cache_limit_bytes // largest - cfg.prefetch_shards - 1) // 2)
    block = min(cfg.shuffle_block_shards or fit, len(manifest.shards_of("train")))
    what = f"a shuffle block of {block} shards (data.shuffle_block_shards), which every step reads from,"
    require_cache_room(url, manifest, cfg.cache_limit_bytes, shards=block, what=what)
    return block


def require_block_room(member: DatasetMember, block: int) -> None:
    """A resume adopts the checkpoint's shuffle block of `block` shards for `member` (its data.shuffle_block_shards
    left null): a URL member's cache must hold it, as `remote_block_shards` checks at open for the block it picks."""
    if member.url is None:
        return
    from gaudi3_scale.data.remote import require_cache_room

    what = f"the checkpoint's shuffle block of {block} shards, which every step reads from,"
    try:
        require_cache_room(member.url, member.manifest, member.cache_limit_bytes, shards=block, what=what)
    except UserInputError as e:
        raise UserInputError(
            f"{e} (the block size comes from the checkpoint's sampler state, which its data order depends on: resume "
            "with at least that cache, or start over in a new --out directory)"
        ) from None


def _open_member(
    cfg: DataConfig, source: str, *, name: str, weight: float, field: str, progress: bool
) -> DatasetMember:
    from gaudi3_scale.data.prepare import prepare_dataset
    from gaudi3_scale.data.remote import is_url

    if is_url(source):
        return _remote_member(cfg, source, name=name, weight=weight, field=field)
    member_cfg = dataclasses.replace(cfg, source=source, mixture=None)
    if cfg.prepared_dir is not None and is_url(cfg.prepared_dir):
        from gaudi3_scale.data.publish import publish_prepared

        local = prepare_dataset(dataclasses.replace(member_cfg, prepared_dir=None), progress=progress)
        url = publish_prepared(local, cfg.prepared_dir, field="data.prepared_dir")
        return _remote_member(cfg, url, name=name, weight=weight, field="data.prepared_dir")
    directory = prepare_dataset(member_cfg, progress=progress)
    return training_data_from_dir(directory, name=name, weight=weight, block_shards=cfg.shuffle_block_shards)


def open_training_data(cfg: DataConfig, *, progress: bool = True) -> TrainingData:
    """Prepare what needs preparing and open every member; bad input is one `UserInputError` line."""
    if cfg.mixture is None:
        member = _open_member(
            cfg, cfg.source, name="data", weight=1.0, field="data.source", progress=progress
        )
        return TrainingData(members=[member])
    members = [
        _open_member(cfg, m.source, name=m.label, weight=m.weight, field=f"data.mixture[{i}].source",
                     progress=progress)
        for i, m in enumerate(cfg.mixture)
    ]  # fmt: skip
    _check_one_tokenizer(members)
    return TrainingData(members=members)


def _check_one_tokenizer(members: list[DatasetMember]) -> None:
    """Mixed token streams must mean the same thing: every member's tokenizer.json must be the same file."""
    digests = {}
    for m in members:
        data = (m.directory / m.manifest.tokenizer_file).read_bytes()
        digests[m.name] = hashlib.sha256(data).hexdigest()
    if len(set(digests.values())) > 1:
        first = members[0].name
        other = next(n for n, d in digests.items() if d != digests[first])
        raise ConfigError(
            "data.mixture",
            f"{first} and {other} were prepared with different tokenizers; prepare every member with one "
            "tokenizer (data.tokenizer byte, or a tokenizer.json path)",
        )
