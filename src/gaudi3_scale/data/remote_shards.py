"""A URL dataset's shards as a `ShardedTokens` opener: picklable, one cache handle per process and URL.

`RemoteShardOpener` travels to DataLoader workers as its URL, cache settings and shard list; each process opens
its own `RemoteDataset` (its prefetch threads do not survive a fork) on first use. The train and val splits of one
URL share the handle, so they share one cache budget and one prefetch queue.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gaudi3_scale.data.config import DataConfig
from gaudi3_scale.data.manifest import Shard
from gaudi3_scale.data.remote import RemoteDataset, default_remote_cache_dir

__all__ = ["RemoteShardOpener", "remote_settings"]

_HANDLES: dict[tuple[int, str], RemoteDataset] = {}


def remote_settings(cfg: DataConfig, url: str, *, field: str) -> dict[str, Any]:
    """`RemoteDataset.open` keyword arguments from the data config (`data.cache_dir` gets a directory per URL)."""
    return {
        # one subdirectory per URL: the members of a mixture must not share a manifest.json
        "cache_dir": Path(cfg.cache_dir).expanduser() / default_remote_cache_dir(url).name
        if cfg.cache_dir
        else None,
        "cache_limit_bytes": cfg.cache_limit_bytes,
        # The loader's hints say how far ahead to fetch (the blocks in use and next, plus data.prefetch_shards);
        # 0 turns prefetching off.
        "prefetch_shards": 1 << 20 if cfg.prefetch_shards else 0,
        "fetch_retry_s": cfg.fetch_retry_s,
        "field": field,
    }


class RemoteShardOpener:
    """Shard `index` of one split: fetched (or found) in the local cache, then memory-mapped."""

    def __init__(
        self, url: str, settings: dict[str, Any], shards: Sequence[Shard], dtype: np.dtype[Any]
    ) -> None:
        self.url, self.settings, self.shards, self.dtype = url, dict(settings), list(shards), np.dtype(dtype)

    @staticmethod
    def handle(url: str, settings: dict[str, Any]) -> RemoteDataset:
        key = (os.getpid(), url)  # a forked worker opens its own: the parent's prefetch threads are not in it
        remote = _HANDLES.get(key)
        if remote is None:
            remote = _HANDLES[key] = RemoteDataset.open(url, **settings)
        return remote

    def __call__(self, index: int) -> np.ndarray:
        shard = self.shards[index]
        if shard.num_tokens == 0:
            return np.empty(0, dtype=self.dtype)
        path = self.handle(self.url, self.settings).shard_path(shard)
        return np.memmap(path, dtype=self.dtype, mode="r", shape=(shard.num_tokens,))

    def prefetch(self, indices: Sequence[int]) -> None:
        self.handle(self.url, self.settings).prefetch([self.shards[i] for i in indices])

    def stats(self) -> dict[str, float]:
        return dict(self.handle(self.url, self.settings).stats())
