"""ShardedTokens: windows read by virtual offset from several shards equal the same windows of the flat stream."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from gaudi3_scale.data.sampler import val_window_starts
from gaudi3_scale.data.shards import LocalShardOpener, ShardedTokens, val_window_starts_sharded

COUNTS = [50, 0, 7, 120, 33]


def _shards(tmp_path: Path) -> tuple[ShardedTokens, np.ndarray]:
    flat = np.random.default_rng(0).integers(0, 60_000, sum(COUNTS)).astype("<u2")
    paths, at = [], 0
    for i, n in enumerate(COUNTS):
        path = tmp_path / f"train-{i:05d}.bin"
        flat[at : at + n].tofile(path)
        paths.append(path)
        at += n
    opener = LocalShardOpener(paths, COUNTS, np.dtype("<u2"))
    return ShardedTokens(COUNTS, opener, dtype=np.dtype("<u2"), max_open=2), flat


def test_gather_reads_each_window_from_its_shard(tmp_path: Path) -> None:
    tokens, flat = _shards(tmp_path)
    offsets = np.arange(6, dtype=np.int64)
    # every start whose window lies inside one non-empty shard
    bases = np.cumsum([0, *COUNTS])
    starts = np.array([s for b, n in zip(bases, COUNTS, strict=False) for s in range(b, b + n - 5)])
    windows = tokens.gather(starts, offsets)
    assert windows.shape == (len(starts), 6)
    assert np.array_equal(windows, flat[starts[:, None] + offsets])
    shard, local = tokens.locate(starts)
    assert set(shard.tolist()) == {0, 2, 3, 4}  # never the empty shard 1
    assert (local >= 0).all() and (local + 6 <= np.array(COUNTS)[shard]).all()
    assert len(tokens._open) <= 2  # bounded mappings
    again = pickle.loads(pickle.dumps(tokens))
    assert again._open == {} and np.array_equal(again.gather(starts, offsets), windows)


@pytest.mark.parametrize("micro,batches,world", [(4, 3, 1), (2, 100, 1), (3, 4, 2)])
def test_sharded_val_windows_stay_in_shards_and_equal_the_flat_rule_for_one_shard(
    micro: int, batches: int, world: int
) -> None:
    for rank in range(world):
        one = val_window_starts_sharded([1000], 16, micro_batch_size=micro, max_batches=batches,
                                        world_size=world, rank=rank)  # fmt: skip
        flat = val_window_starts(
            1000, 16, micro_batch_size=micro, max_batches=batches, world_size=world, rank=rank
        )
        assert np.array_equal(one, flat)
    starts = val_window_starts_sharded(COUNTS, 16, micro_batch_size=micro, max_batches=batches)
    bases = np.cumsum([0, *COUNTS])[:-1]
    shard = np.searchsorted(bases, starts, side="right") - 1
    assert (starts - bases[shard] + 17 <= np.array(COUNTS)[shard]).all()  # x and y inside the shard
    assert len(set(starts.ravel().tolist())) == starts.size  # distinct windows


def test_validation_reads_few_shards_of_a_large_split_spread_over_it() -> None:
    counts = [1000] * 500  # 31 windows of 32 tokens each
    starts = val_window_starts_sharded(counts, 32, micro_batch_size=4, max_batches=20)  # 80 windows
    assert starts.size == 80
    shards = np.unique(starts // 1000)
    assert len(shards) == 3 and shards[0] == 0 and shards[-1] >= 300  # 3 shards, from across the split
