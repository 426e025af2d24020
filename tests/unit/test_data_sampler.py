"""WindowSampler: a bijective shuffle, world-size-independent global batches, exact resume, loud refusals."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.data.sampler import (
    SAMPLER_STATE_FORMAT,
    WindowSampler,
    accumulation_steps,
    feistel_permute,
    val_window_starts,
)

NUM_TOKENS = 100_000
T = 16


def make(world_size: int = 1, rank: int = 0, **kw: int) -> WindowSampler:
    num_tokens = kw.pop("num_tokens", NUM_TOKENS)
    args: dict[str, int] = {"global_batch_size": 16, "micro_batch_size": 2, "seed": 7} | kw
    return WindowSampler(num_tokens, T, world_size=world_size, rank=rank, **args)


@given(n=st.integers(1, 5000), seed=st.integers(0, 2**32), epoch=st.integers(0, 1000))
def test_feistel_is_a_bijection(n: int, seed: int, epoch: int) -> None:
    perm = feistel_permute(np.arange(n), n, seed, epoch)
    assert perm.dtype == np.int64
    assert np.array_equal(np.sort(perm), np.arange(n))


def test_feistel_scales_without_memory() -> None:
    n = 3_000_000_017  # billions of windows: only the requested slice is ever materialized
    images = feistel_permute(np.arange(10**6, 10**6 + 200_000), n, seed=1, epoch=0)
    assert images.min() >= 0 and images.max() < n
    assert len(np.unique(images)) == 200_000
    assert images.max() > n // 2  # spread over the whole range, not a local shuffle


def test_feistel_depends_on_seed_and_epoch() -> None:
    n = 1000
    base = feistel_permute(np.arange(n), n, 0, 0)
    assert np.array_equal(base, feistel_permute(np.arange(n), n, 0, 0))
    assert not np.array_equal(base, feistel_permute(np.arange(n), n, 0, 1))
    assert not np.array_equal(base, feistel_permute(np.arange(n), n, 1, 0))
    assert np.mean(base == np.arange(n)) < 0.02  # a real shuffle: few fixed points


def test_num_windows_and_stride() -> None:
    assert make().num_windows == NUM_TOKENS - T
    strided = make(stride=5, num_tokens=1000)
    assert strided.num_windows == (1000 - T - 1) // 5 + 1
    starts = np.concatenate([strided.step_starts(s).ravel() for s in range(30)])
    assert np.all(starts % 5 == 0)
    assert starts.max() <= 1000 - T - 1


def test_one_epoch_visits_every_window_once() -> None:
    sampler = make(num_tokens=T + 160, global_batch_size=16, micro_batch_size=4)  # 160 windows = 10 steps
    assert sampler.num_windows == 160
    epoch0 = np.concatenate([sampler.step_starts(s).ravel() for s in range(10)])
    assert np.array_equal(np.sort(epoch0), np.arange(160))
    epoch1 = np.concatenate([sampler.step_starts(s).ravel() for s in range(10, 20)])
    assert np.array_equal(np.sort(epoch1), np.arange(160))
    assert not np.array_equal(epoch0, epoch1)


@pytest.mark.parametrize("world_size", [1, 2])
def test_steps_starts_is_step_starts_stacked(world_size: int) -> None:
    # 160 windows, 16 per step: steps 3..27 cross two epoch boundaries inside one vectorized call.
    for rank in range(world_size):
        sampler = make(world_size, rank, num_tokens=T + 160, global_batch_size=16, micro_batch_size=4)
        many = sampler.steps_starts(3, 25)
        assert many.shape == (25, sampler.accum_steps, 4)
        for i in range(25):
            assert np.array_equal(many[i], sampler.step_starts(3 + i))


def test_deterministic_and_seeded() -> None:
    assert np.array_equal(make().step_starts(5), make().step_starts(5))
    assert not np.array_equal(make().step_starts(5), make(seed=8).step_starts(5))


@pytest.mark.parametrize(("world_size", "micro"), [(1, 2), (2, 2), (4, 2), (2, 8), (4, 4)])
def test_ranks_partition_the_global_batch(world_size: int, micro: int) -> None:
    reference = make(micro_batch_size=16)  # world 1, one micro-step: the whole global batch at once
    for step in (0, 3, 6249, 6250):  # 6249/6250 straddle the end of the first epoch
        expected = reference.micro_batch_starts(step, 0)
        ranks = [make(world_size, r, micro_batch_size=micro) for r in range(world_size)]
        accum = ranks[0].accum_steps
        assert accum == 16 // (micro * world_size)
        pieces = [ranks[r].micro_batch_starts(step, a) for a in range(accum) for r in range(world_size)]
        assert all(len(p) == micro for p in pieces)
        assert np.array_equal(np.concatenate(pieces), expected)  # order: (a * world + r) * micro
        assert len(np.unique(np.concatenate(pieces))) == 16  # disjoint across ranks and micro-steps
        for sampler in ranks:  # the vectorized per-step call agrees with the per-micro-step one
            per_micro = [sampler.micro_batch_starts(step, a) for a in range(accum)]
            assert np.array_equal(sampler.step_starts(step), np.stack(per_micro))


def test_resume_from_state_gives_identical_batches() -> None:
    run = make(world_size=2, rank=1)
    state = run.state_dict(samples_consumed=3 * 16)
    assert state == {
        "format": SAMPLER_STATE_FORMAT,
        "seed": 7,
        "stride": 1,
        "num_windows": NUM_TOKENS - T,
        "context_length": T,
        "num_shards": 1,
        "block_shards": 1,
        "shard_tokens_sha256": hashlib.sha256(np.array([NUM_TOKENS], dtype="<i8").tobytes()).hexdigest(),
        "global_batch_size": 16,
        "samples_consumed": 48,
    }
    resumed = make(world_size=2, rank=1)
    assert resumed.load_state_dict(state) == 3 == resumed.start_step
    for step in range(3, 8):
        assert np.array_equal(resumed.step_starts(step), run.step_starts(step))


def test_resume_on_another_world_size_and_batch_split() -> None:
    state = make(world_size=4, rank=0).state_dict(samples_consumed=10 * 16)
    single = make(micro_batch_size=16)
    assert single.start_step_from_state(state) == 10
    # The stream is counted in samples: with the global batch halved to 8, the run resumes at step 20 and
    # reads the same windows.
    halved = make(global_batch_size=8, micro_batch_size=8)
    assert halved.start_step_from_state(state) == 20
    both = np.concatenate([halved.micro_batch_starts(20, 0), halved.micro_batch_starts(21, 0)])
    assert np.array_equal(both, single.micro_batch_starts(10, 0))


@pytest.mark.parametrize(
    ("change", "key"),
    [({"num_tokens": NUM_TOKENS + 1}, "num_windows"), ({"seed": 1}, "seed"), ({"stride": 2}, "stride")],
)
def test_resume_refuses_another_stream(change: dict[str, int], key: str) -> None:
    state = make().state_dict(samples_consumed=32)
    with pytest.raises(UserInputError, match=f"{key} was .*, now .*same prepared dataset"):
        make(**change).start_step_from_state(state)


def test_allow_data_change_reads_a_whole_saved_block_as_all_shards_and_keeps_a_partial_one() -> None:
    """train.allow_data_change: a saved block of all the shards then (1 of 1) passes against all of the grown data's
    (4 of 4); a saved block of some of them (2 of 4) is the stream's order and must stay, even against all."""

    def sampler(shards: int, block: int, allow: bool = True) -> WindowSampler:
        return WindowSampler([20_000] * shards, T, global_batch_size=16, micro_batch_size=2, seed=7,
                             block_shards=block, allow_data_change=allow)  # fmt: skip

    grown = sampler(4, 4)
    assert grown.start_step_from_state(sampler(1, 1, False).state_dict(samples_consumed=32)) == 2
    partial = sampler(4, 2, False).state_dict(samples_consumed=32)
    with pytest.raises(UserInputError, match="block_shards was 2, now 4"):
        grown.start_step_from_state(partial)
    assert sampler(4, 2).start_step_from_state(partial) == 2
    assert sampler(1, 2).start_step_from_state(partial) == 2  # shrunk below the saved block: all of it


def test_resume_refuses_other_context_and_format() -> None:
    state = make().state_dict(samples_consumed=32)
    other = WindowSampler(NUM_TOKENS, T + 1, global_batch_size=16, micro_batch_size=2, seed=7)
    with pytest.raises(UserInputError, match="context_length was 16, now 17"):
        other.start_step_from_state(state)
    with pytest.raises(UserInputError, match="format 'nope'"):
        make().start_step_from_state(state | {"format": "nope"})
    with pytest.raises(UserInputError, match="samples_consumed must be an integer"):
        make().start_step_from_state(state | {"samples_consumed": -16})


def test_resume_refuses_a_global_batch_that_does_not_divide() -> None:
    state = make().state_dict(samples_consumed=3 * 16)
    with pytest.raises(
        UserInputError, match=r"48 samples consumed is not a multiple of global_batch_size 32 \(it was 16\)"
    ):
        make(global_batch_size=32).start_step_from_state(state)


def test_constructor_validation() -> None:
    with pytest.raises(
        ConfigError, match=r"global_batch_size: 16 is not divisible by .* \(4\) × ranks \(3\) = 12"
    ):
        make(world_size=3, micro_batch_size=4)
    with pytest.raises(ConfigError, match=r"rank: must be in \[0, world_size=2\)"):
        make(world_size=2, rank=2)
    with pytest.raises(UserInputError, match="has 16 tokens, fewer than context_length \\+ 1 = 17"):
        make(num_tokens=16)
    with pytest.raises(ConfigError, match="seed: must be >= 0"):
        make(seed=-1)
    with pytest.raises(ValueError, match=r"micro_step must be in \[0, 8\)"):
        make().micro_batch_starts(0, 8)
    assert accumulation_steps(64, 4, 2) == 8


def test_tiny_dataset_wraps_epochs_inside_a_batch() -> None:
    sampler = make(num_tokens=T + 3, global_batch_size=8, micro_batch_size=8)  # 3 windows, 8 per batch
    starts = sampler.micro_batch_starts(0, 0)
    assert sorted(starts[:3].tolist()) == [0, 1, 2] and sorted(starts[3:6].tolist()) == [0, 1, 2]


def test_val_windows_are_fixed_spread_and_disjoint() -> None:
    starts = val_window_starts(10_000, 16, micro_batch_size=4, max_batches=5)
    assert starts.shape == (5, 4)
    flat = starts.ravel()
    assert np.all(np.diff(flat) >= 16)  # non-overlapping x windows, in order
    assert flat[0] == 0 and flat[-1] > 10_000 * 0.9  # spread over the whole split
    assert np.all(flat % 16 == 0) and flat[-1] + 17 <= 10_000


def test_val_windows_cap_and_ranks() -> None:
    def shape(num_tokens: int, max_batches: int = 100) -> tuple[int, ...]:
        return val_window_starts(num_tokens, 16, micro_batch_size=4, max_batches=max_batches).shape

    assert shape(16 * 10 + 1) == (2, 4)  # 10 windows → 2 full batches
    assert shape(16 * 3 + 1) == (1, 3)  # fewer than micro: one short batch
    assert shape(10, max_batches=5) == (0, 4)
    full = val_window_starts(10_000, 16, micro_batch_size=4, max_batches=5)
    ranks = [
        val_window_starts(10_000, 16, micro_batch_size=4, max_batches=5, world_size=2, rank=r) for r in (0, 1)
    ]
    assert [len(r) for r in ranks] == [2, 2]  # 5 batches → 4 usable, 2 per rank
    interleaved = np.concatenate([ranks[0][:1], ranks[1][:1], ranks[0][1:], ranks[1][1:]])
    assert np.array_equal(interleaved, full[:4])


# Streams of the single-file sampler (before shards existed), recorded from it: a one-shard dataset must keep
# giving these, so that old checkpoints resume on the very same batches.
_RECORDED_STREAMS = [
    # (num_tokens, T, global, micro, world, rank, seed, stride, first_step, num_steps, sha256[:16] of int64 starts)
    (100_000, 16, 16, 2, 1, 0, 7, 1, 0, 50, "727566170975e65d"),
    (100_000, 16, 16, 2, 2, 1, 7, 1, 6240, 20, "d9004095ce833e28"),
    (1000, 16, 16, 4, 1, 0, 3, 5, 0, 40, "3bdb98ca972b2615"),
    (19, 16, 8, 8, 1, 0, 0, 1, 0, 5, "80e7c7b30061aeba"),
    (10**9, 2048, 64, 4, 4, 3, 1234, 2048, 10**5, 8, "0d98f50bbdf37787"),
]


@pytest.mark.parametrize("config", _RECORDED_STREAMS)
def test_single_shard_streams_are_unchanged(config: tuple[Any, ...]) -> None:
    num_tokens, t, global_batch, micro, world, rank, seed, stride, first, count, digest = config
    sampler = WindowSampler(
        num_tokens,
        t,
        global_batch_size=global_batch,
        micro_batch_size=micro,
        world_size=world,
        rank=rank,
        seed=seed,
        stride=stride,
    )
    starts = sampler.steps_starts(first, count).astype(np.int64)
    assert hashlib.sha256(starts.tobytes()).hexdigest()[:16] == digest


def test_single_shard_stream_literal() -> None:
    sampler = WindowSampler(16 + 40, 16, global_batch_size=8, micro_batch_size=4, seed=5)
    assert sampler.steps_starts(0, 6).ravel().tolist() == [
        10, 20, 29, 39, 8, 6, 14, 24, 1, 22, 23, 38, 34, 13, 5, 35, 12, 26, 30, 9, 33, 21, 0, 15,
        37, 3, 7, 2, 25, 16, 19, 4, 31, 17, 18, 11, 32, 36, 27, 28, 15, 24, 0, 30, 32, 39, 16, 29,
    ]  # fmt: skip


SHARDS = [0, 40, 5, 16, 17, 100, 0, 33, 60, 18]  # empty, short (< T + 1), exactly T + 1, and longer shards


def sharded(shard_tokens: list[int] = SHARDS, world_size: int = 1, rank: int = 0, **kw: Any) -> WindowSampler:
    args: dict[str, Any] = {"global_batch_size": 8, "micro_batch_size": 2, "seed": 3} | kw
    return WindowSampler(shard_tokens, T, world_size=world_size, rank=rank, **args)


def all_windows(shard_tokens: list[int], stride: int) -> list[int]:
    """Every window's virtual start, counted independently of the sampler."""
    starts, base = [], 0
    for tokens in shard_tokens:
        starts += [base + off for off in range(0, tokens - T, stride) if off + T + 1 <= tokens]
        base += tokens
    return sorted(starts)


@pytest.mark.parametrize("stride", [1, 3])
@pytest.mark.parametrize("block_shards", [None, 1, 2, 3, 100])
def test_sharded_epoch_visits_every_window_once_inside_its_shard(
    stride: int, block_shards: int | None
) -> None:
    sampler = sharded(stride=stride, block_shards=block_shards)
    expected = all_windows(SHARDS, stride)
    assert sampler.num_windows == len(expected) and sampler.num_shards == len(SHARDS)
    epochs = []
    for epoch in range(2):
        starts = sampler.sample_starts(np.arange(epoch * len(expected), (epoch + 1) * len(expected)))
        assert sorted(starts.tolist()) == expected
        shard, local = sampler.locate(starts)
        assert np.all(local + T + 1 <= np.asarray(SHARDS)[shard]) and np.all(local % stride == 0)
        assert np.array_equal(sampler.shard_bases[shard] + local, starts)
        epochs.append(starts)
    assert not np.array_equal(epochs[0], epochs[1])


def test_one_block_is_the_default_and_the_resolved_block_size() -> None:
    default = sharded()
    live = sum(1 for t in SHARDS if t > T)
    assert default.block_shards == live and default.num_blocks == 1
    many = sharded(block_shards=100)
    assert many.block_shards == live
    samples = np.arange(500)
    assert np.array_equal(default.sample_starts(samples), many.sample_starts(samples))
    assert not np.array_equal(default.sample_starts(samples), sharded(block_shards=2).sample_starts(samples))


@pytest.mark.parametrize("block_shards", [1, 2, 3])
def test_blocks_keep_reads_local_and_upcoming_shards_names_them(block_shards: int) -> None:
    sampler = sharded(block_shards=block_shards)
    n, live = sampler.num_windows, len(sampler._live_shards)
    for epoch in range(3):
        order = sampler.upcoming_shards(epoch * n, live)
        assert sorted(order) == [j for j, t in enumerate(SHARDS) if t > T]
        block_of = {shard: i // block_shards for i, shard in enumerate(order)}
        shards, _ = sampler.locate(sampler.sample_starts(np.arange(epoch * n, (epoch + 1) * n)))
        blocks = np.array([block_of[s] for s in shards.tolist()])
        assert np.all(np.diff(blocks) >= 0)  # a block's windows are consecutive: reads stay in its shards
        for block in range(sampler.num_blocks):  # and the block reads exactly its own shards
            assert set(shards[blocks == block].tolist()) == set(order[block * block_shards :][:block_shards])
        # From inside a block: that block's shards first, then the later ones, in order.
        middle = epoch * n + int(np.flatnonzero(blocks == 1)[-1])
        assert sampler.upcoming_shards(middle, live)[:block_shards] == order[block_shards : 2 * block_shards]


def test_upcoming_shards_crosses_epochs_and_stays_distinct() -> None:
    sampler = sharded(block_shards=2)
    live = len(sampler._live_shards)
    last = sampler.num_windows - 1
    upcoming = sampler.upcoming_shards(last, 100)
    assert len(upcoming) == live == len(set(upcoming))
    next_epoch = sampler.upcoming_shards(sampler.num_windows, live)
    assert upcoming[:2] == sampler.upcoming_shards(last, 2)
    assert upcoming[2:] == [s for s in next_epoch if s not in upcoming[:2]][: live - 2]


def test_block_shuffle_mixes_the_shards_of_a_block() -> None:
    sampler = WindowSampler([5000] * 8, T, global_batch_size=8, micro_batch_size=8, seed=1, block_shards=4)
    shards, _ = sampler.locate(sampler.sample_starts(np.arange(200)))
    assert len(set(shards.tolist())) == 4  # one block, all four of its shards within the first 200 samples
    assert np.count_nonzero(np.diff(shards)) > 100  # interleaved, not shard after shard


@pytest.mark.parametrize("block_shards", [None, 1, 4])
def test_sharded_batched_calls_match_one_sample_at_a_time(block_shards: int | None) -> None:
    sampler = sharded(block_shards=block_shards, global_batch_size=16, micro_batch_size=4)
    many = sampler.steps_starts(0, 30)  # 480 samples: several epochs and blocks inside one call
    one_by_one = [sampler.sample_starts(np.array([k]))[0] for k in range(480)]
    assert many.ravel().tolist() == one_by_one


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_ranks_partition_steps_and_resume_anywhere(world_size: int) -> None:
    single = sharded(block_shards=2, global_batch_size=16, micro_batch_size=16)
    state = sharded(block_shards=2, global_batch_size=16, micro_batch_size=16).state_dict(
        samples_consumed=5 * 16
    )
    ranks = [
        sharded(block_shards=2, world_size=world_size, rank=r, global_batch_size=16, micro_batch_size=2)
        for r in range(world_size)
    ]
    for sampler in ranks:
        assert sampler.load_state_dict(state) == 5
    for step in range(5, 40):
        per_rank = [r.step_starts(step) for r in ranks]
        pieces = [per_rank[r][a] for a in range(ranks[0].accum_steps) for r in range(world_size)]
        assert np.array_equal(np.concatenate(pieces), single.step_starts(step)[0])


def test_sharded_state_names_the_layout() -> None:
    state = sharded(block_shards=2).state_dict(samples_consumed=16)
    assert state["format"] == SAMPLER_STATE_FORMAT == "gaudi3-scale/window-sampler/2"
    assert (state["num_shards"], state["block_shards"]) == (len(SHARDS), 2)
    assert sharded(block_shards=2).start_step_from_state(state) == 2
    with pytest.raises(UserInputError, match="block_shards was 2, now 3; resume with the same"):
        sharded(block_shards=3).start_step_from_state(state)
    moved = [*SHARDS[:-2], SHARDS[-2] + 1, SHARDS[-1] - 1]  # same windows in total, another layout
    assert sharded(moved, block_shards=2).num_windows == sharded().num_windows
    with pytest.raises(UserInputError, match=r"shard_tokens_sha256 was '[0-9a-f]+.*', now '[0-9a-f]+'"):
        sharded(moved, block_shards=2).start_step_from_state(state)


def test_version_1_states_resume_on_one_shard_only() -> None:
    v1 = make().state_dict(samples_consumed=48)
    v1 = {k: v for k, v in v1.items() if k not in ("num_shards", "block_shards", "shard_tokens_sha256")}
    v1["format"] = "gaudi3-scale/window-sampler/1"
    assert make().start_step_from_state(v1) == 3
    assert (
        WindowSampler([NUM_TOKENS], T, global_batch_size=16, micro_batch_size=2, seed=7).load_state_dict(v1)
        == 3
    )
    with pytest.raises(UserInputError, match="num_shards was 1, now 2"):
        WindowSampler(
            [NUM_TOKENS, 0], T, global_batch_size=16, micro_batch_size=2, seed=7
        ).start_step_from_state(v1)


def test_shard_validation_and_empty_datasets() -> None:
    with pytest.raises(
        UserInputError, match="has 31 tokens in 3 shards, each fewer than context_length \\+ 1 = 17"
    ):
        sharded([16, 0, 15])
    with pytest.raises(UserInputError, match="has 0 tokens in 0 shards"):
        sharded([])
    with pytest.raises(UserInputError, match="shard token counts must be integers >= 0"):
        sharded([100, -1])
    with pytest.raises(UserInputError, match=r"shard token counts must be integers >= 0, got \[100, 2.5\]"):
        sharded([100, 2.5])  # a float count is a bug upstream, not a truncation
    with pytest.raises(ConfigError, match="block_shards: must be > 0"):
        sharded(block_shards=0)
    assert sharded([T + 1]).sample_starts(np.arange(3)).tolist() == [0, 0, 0]
    # Two windows, and rank 1 of 2 reads samples 2, 3, 6, 7, ...: epochs 0, 2, 4 have none of its samples.
    tiny = sharded(
        [T + 1, T + 1], world_size=2, rank=1, global_batch_size=4, micro_batch_size=2, block_shards=1
    )
    assert sorted(tiny.steps_starts(0, 3).ravel().tolist()) == [0, 0, 0, T + 1, T + 1, T + 1]


def test_locate_skips_empty_shards() -> None:
    sampler = sharded([0, 20, 0, 0, 30, 0])
    shard, local = sampler.locate(np.array([0, 3, 20, 33]))
    assert shard.tolist() == [1, 1, 4, 4] and local.tolist() == [0, 3, 0, 13]


@pytest.mark.parametrize(
    ("block_shards", "digest"), [(None, "cce5cbd9e73dcc24"), (1, "4bb904b5189fe141"), (3, "e9a29714b3caf087")]
)
def test_sharded_streams_are_pinned(block_shards: int | None, digest: str) -> None:
    # Checkpoints resume on these streams: a change to the shard order or block keys must be a new state format.
    sampler = sharded(block_shards=block_shards, global_batch_size=16, micro_batch_size=4)
    starts = sampler.steps_starts(0, 40).astype(np.int64)
    assert hashlib.sha256(starts.tobytes()).hexdigest()[:16] == digest
