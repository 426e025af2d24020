"""One split of one prepared dataset as shards, read by *virtual offset*: the position in the shards' concatenation.

The sampler hands out virtual window starts (`sampler.WindowSampler`); a window never straddles two shards, so
``gather`` maps each start to its shard with one ``searchsorted`` and reads every window of a shard with one fancy
index. Shards come from an opener: local memmaps (`local_shards`), or files that a URL dataset's cache fetched
(`data.remote`). The opener is what travels to DataLoader worker processes, so it must pickle small: a local one
pickles as paths, a remote one as its URL and cache settings (each process opens its own cache handle; the
cache's file locks make ranks and workers on one node share one copy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = ["LocalShardOpener", "ShardOpener", "ShardedTokens", "val_window_starts_sharded"]


class ShardOpener(Protocol):
    def __call__(self, index: int) -> np.ndarray: ...


class LocalShardOpener:
    """Shard `index` as a read-only memmap of `paths[index]` (an empty array for a 0-token shard)."""

    def __init__(self, paths: Sequence[Path], shard_tokens: Sequence[int], dtype: np.dtype[Any]) -> None:
        self.paths = [str(p) for p in paths]
        self.shard_tokens = [int(n) for n in shard_tokens]
        self.dtype = np.dtype(dtype)

    def __call__(self, index: int) -> np.ndarray:
        count = self.shard_tokens[index]
        if count == 0:  # mmap cannot map an empty file
            return np.empty(0, dtype=self.dtype)
        return np.memmap(self.paths[index], dtype=self.dtype, mode="r", shape=(count,))


class ShardedTokens:
    """The token shards of one split; windows are gathered by virtual offset."""

    def __init__(
        self,
        shard_tokens: Sequence[int],
        opener: ShardOpener,
        *,
        dtype: np.dtype[Any],
        prefetch: Callable[[Sequence[int]], None] | None = None,
        max_open: int = 64,
    ) -> None:
        self.shard_tokens = [int(n) for n in shard_tokens]
        self.bases = np.concatenate([[0], np.cumsum(self.shard_tokens, dtype=np.int64)])[:-1]
        self.num_tokens = int(sum(self.shard_tokens))
        self.dtype = np.dtype(dtype)
        self.opener = opener
        self._prefetch = prefetch
        self._max_open = max_open
        self._open: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_tokens

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = {}  # memmaps are reopened in the receiving process
        return state

    def shard(self, index: int) -> np.ndarray:
        array = self._open.get(index)
        if array is None:
            if len(self._open) >= self._max_open:  # bound the mappings held: drop the oldest opened
                self._open.pop(next(iter(self._open)))
            array = self._open[index] = self.opener(index)
        return array

    @property
    def fetches(self) -> bool:
        """Whether shards come from a fetching cache that wants prefetch hints."""
        return self._prefetch is not None

    def prefetch(self, shards: Sequence[int]) -> None:
        """Hint the shards needed next, in order (a URL dataset fetches them ahead; local shards need nothing)."""
        if self._prefetch is not None:
            self._prefetch(shards)

    def locate(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Virtual offsets → (shard index, offset within that shard). A start inside a 0-token shard's position
        belongs to the next non-empty shard (`side="right"`)."""
        index = np.searchsorted(self.bases, starts, side="right") - 1
        return index, starts - self.bases[index]

    def gather(self, starts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """``tokens[s + offsets]`` for every virtual start s, shape [len(starts), len(offsets)]."""
        starts = np.asarray(starts, dtype=np.int64)
        if len(self.shard_tokens) == 1:
            return self.shard(0)[starts[:, None] + offsets]
        index, local = self.locate(starts)
        out = np.empty((len(starts), len(offsets)), dtype=self.dtype)
        for shard in np.unique(index).tolist():
            sel = index == shard
            out[sel] = self.shard(shard)[local[sel, None] + offsets]
        return out


def val_window_starts_sharded(
    shard_tokens: Sequence[int],
    context_length: int,
    *,
    micro_batch_size: int,
    max_batches: int,
    world_size: int = 1,
    rank: int = 0,
) -> np.ndarray:
    """Virtual offsets of a fixed validation set over several shards: non-overlapping windows (stride T) inside
    each shard, spread evenly over them. With one shard this is exactly `sampler.val_window_starts`.

    Only as many shards as the batches need are read, evenly spaced over the split (so a dataset streamed from a
    URL fetches a few val shards per validation, not all of them, and they still come from across the sources).

    Shape [batches, micro]; the rank split is `val_window_starts`'s (every rank runs the same number of batches).
    The trainer's validation set asks for one process's batches and splits them itself (`data.loader._rank_share`,
    the same split for one dataset, and one that keeps a mixture's weights).
    """
    from gaudi3_scale.data.sampler import val_window_starts

    per_shard = np.array(
        [(n - 1) // context_length if n > context_length else 0 for n in shard_tokens], dtype=np.int64
    )
    per_shard = _fewest_spread_shards(per_shard, max_batches * micro_batch_size)
    available = int(per_shard.sum())
    # val_window_starts over a flat split of `available` windows gives the evenly spaced window indices …
    flat = val_window_starts(
        available * context_length + 1,
        context_length,
        micro_batch_size=micro_batch_size,
        max_batches=max_batches,
        world_size=world_size,
        rank=rank,
    )
    # … which are then mapped to (shard, window within shard) → virtual offset.
    window = flat // context_length
    first_window = np.concatenate([[0], np.cumsum(per_shard)])[:-1]
    shard = np.searchsorted(first_window, window, side="right") - 1
    bases = np.concatenate([[0], np.cumsum(np.asarray(shard_tokens, dtype=np.int64))])[:-1]
    return bases[shard] + (window - first_window[shard]) * context_length


def _fewest_spread_shards(windows: np.ndarray, needed: int) -> np.ndarray:
    """`windows` per shard with all but the fewest evenly spaced shards (those with windows) zeroed, such that the
    kept ones hold at least `needed` windows (all of them when the split holds fewer)."""
    candidates = np.flatnonzero(windows)
    if int(windows.sum()) <= needed or len(candidates) <= 1:
        return windows
    start = max(1, int(needed / windows[candidates].mean()) - 1)  # about right at once: few iterations
    for count in range(start, len(candidates) + 1):
        kept = candidates[(np.arange(count) * len(candidates)) // count]
        if int(windows[kept].sum()) >= needed:
            out = np.zeros_like(windows)
            out[kept] = windows[kept]
            return out
    return windows
