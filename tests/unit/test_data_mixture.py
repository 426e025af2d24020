"""MixtureSampler: the largest-deficit assignment, per-member streams, world-size-free resume, loud refusals."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data.mixture import MIXTURE_STATE_FORMAT, MixtureSampler, SingleSource
from gaudi3_scale.data.sampler import WindowSampler

T = 16
NAMES = ["web", "code", "books"]
MEMBER_SHARDS: list[Any] = [[3000, 500, 0, 2000], 4000, [100, 900, 40, 700, 1200]]


def members(seed: int = 0, block_shards: int | None = 2) -> list[WindowSampler]:
    return [
        WindowSampler(
            tokens, T, global_batch_size=8, micro_batch_size=8, seed=seed + i, block_shards=block_shards
        )
        for i, tokens in enumerate(MEMBER_SHARDS)
    ]


def mixture(
    weights: list[float] | None = None, world_size: int = 1, rank: int = 0, **kw: Any
) -> MixtureSampler:
    args: dict[str, Any] = {"global_batch_size": 16, "micro_batch_size": 16 // world_size} | kw
    return MixtureSampler(
        members(), weights or [0.5, 0.3, 0.2], NAMES, world_size=world_size, rank=rank, **args
    )


def global_steps(sampler: MixtureSampler, first: int, count: int) -> np.ndarray:
    """[steps, G, 2] (member, start) of whole global batches, reassembled in (micro-step, rank) order."""
    ids, starts = sampler.steps_starts(first, count)
    return np.stack([ids.reshape(count, -1), starts.reshape(count, -1)], axis=-1)


def digest(samples: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(samples, dtype=np.int64).tobytes()).hexdigest()


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1.0, 1.0, 1.0], [3.0, 0.001, 7.0], [0.7, 0.0, 0.3]])
def test_proportions_stay_within_one_sample_of_the_weights(weights: list[float]) -> None:
    sampler = mixture(weights)
    ids = global_steps(sampler, 0, 625)[..., 0].ravel()  # 10,000 samples
    fractions = np.asarray(weights) / sum(weights)
    onehot = ids[:, None] == np.arange(3)[None, :]
    counts = np.vstack([np.zeros((1, 3)), np.cumsum(onehot, axis=0)])  # c_d(k), k = 0 .. 10,000
    assert np.all(np.abs(counts - np.arange(10_001)[:, None] * fractions) < 1)
    assert sampler.counts_at(10_000) == tuple(int(c) for c in counts[-1])
    if 0.0 in weights:
        assert counts[-1][weights.index(0.0)] == 0


def test_each_member_reads_its_own_stream_in_order() -> None:
    sampler = mixture()
    batches = global_steps(sampler, 0, 200).reshape(-1, 2)
    for d, member in enumerate(members()):
        mine = batches[batches[:, 0] == d, 1]
        assert np.array_equal(mine, member.sample_starts(np.arange(len(mine))))
        shard, local = member.locate(mine)  # virtual starts into that member's shards, inside one shard
        assert np.all(local + T + 1 <= member.shard_tokens[shard])


def test_deterministic_and_order_of_calls_does_not_matter() -> None:
    reference = global_steps(mixture(), 0, 40)
    sampler = mixture()
    assert np.array_equal(global_steps(sampler, 25, 15), reference[25:])  # a jump forward walks the counts
    assert np.array_equal(
        global_steps(sampler, 3, 4), reference[3:7]
    )  # and going back restarts from a known point
    assert np.array_equal(global_steps(sampler, 7, 18), reference[7:25])
    assert digest(reference) == digest(global_steps(mixture(), 0, 40))


@pytest.mark.parametrize(("world_size", "micro"), [(1, 16), (2, 4), (4, 2), (4, 4)])
def test_resume_on_another_world_size_gives_the_same_samples(world_size: int, micro: int) -> None:
    uninterrupted = global_steps(mixture(), 0, 30)
    state = mixture(world_size=2, micro_batch_size=8).state_dict(samples_consumed=12 * 16)
    assert state["format"] == MIXTURE_STATE_FORMAT and state["samples_consumed"] == 192
    assert [m["name"] for m in state["members"]] == NAMES and sum(
        m["consumed"] for m in state["members"]
    ) == 192
    ranks = [mixture(world_size=world_size, rank=r, micro_batch_size=micro) for r in range(world_size)]
    assert all(r.load_state_dict(state) == 12 == r.start_step for r in ranks)
    accum = ranks[0].accum_steps
    for first, count in ((12, 5), (17, 13)):
        per_rank = [r.steps_starts(first, count) for r in ranks]
        for i in range(count):
            ids = np.concatenate([per_rank[r][0][i, a] for a in range(accum) for r in range(world_size)])
            starts = np.concatenate([per_rank[r][1][i, a] for a in range(accum) for r in range(world_size)])
            assert digest(np.stack([ids, starts], -1)) == digest(uninterrupted[first + i])


def test_resume_with_another_global_batch_counts_in_samples() -> None:
    uninterrupted = global_steps(mixture(), 0, 10).reshape(-1, 2)
    state = mixture().state_dict(samples_consumed=6 * 16)
    halved = mixture(global_batch_size=8, micro_batch_size=8)
    assert halved.load_state_dict(state) == 12
    assert np.array_equal(global_steps(halved, 12, 8).reshape(-1, 2), uninterrupted[96:])


def test_state_refusals_name_what_differs() -> None:
    state = mixture().state_dict(samples_consumed=32)
    assert mixture().start_step_from_state(state) == 2
    assert mixture([5.0, 3.0, 2.0]).start_step_from_state(state) == 2  # same fractions, same stream
    with pytest.raises(UserInputError, match=r"weights were \[0.5, 0.3, 0.2\], now \[0.3, 0.5, 0.2\]"):
        mixture([0.3, 0.5, 0.2]).start_step_from_state(state)
    renamed = MixtureSampler(
        members(), [0.5, 0.3, 0.2], ["web", "code", "papers"], global_batch_size=16, micro_batch_size=16
    )
    with pytest.raises(
        UserInputError, match=r"members were \['web', 'code', 'books'\], now \['web', 'code', 'papers'\]"
    ):
        renamed.start_step_from_state(state)
    reseeded = MixtureSampler(
        members(seed=9), [0.5, 0.3, 0.2], NAMES, global_batch_size=16, micro_batch_size=16
    )
    with pytest.raises(UserInputError, match="member 'web': seed was 0, now 9; resume with the same"):
        reseeded.start_step_from_state(state)
    with pytest.raises(UserInputError, match="format 'nope'"):
        mixture().start_step_from_state(state | {"format": "nope"})
    damaged = state | {"samples_consumed": 48}
    with pytest.raises(UserInputError, match="do not add up to samples_consumed 48"):
        mixture().start_step_from_state(damaged)
    with pytest.raises(UserInputError, match="32 samples consumed is not a multiple of global_batch_size 24"):
        mixture(global_batch_size=24, micro_batch_size=24).start_step_from_state(state)


@pytest.mark.parametrize(
    ("weights", "names", "message"),
    [
        ([0.0, 0.0, 0.0], NAMES, "weights sum to 0; they must sum to a positive number"),
        ([1e308, 1e308, 1.0], NAMES, r"^data mixture: the weights sum past the largest float \(1.8e\+308\);"),
        ([0.5, -0.1, 0.6], NAMES, "weight of 'code' is -0.1; use a finite number >= 0"),
        ([0.5, float("nan"), 0.6], NAMES, "weight of 'code' is nan"),
        ([0.5, 0.5], NAMES, "3 members, 2 weights and 3 names"),
        ([0.5, 0.3, 0.2], ["web", "web", "books"], "names .* must be distinct strings"),
    ],
)
def test_bad_mixtures_are_one_line(weights: list[float], names: list[str], message: str) -> None:
    with pytest.raises(UserInputError, match=message) as info:
        MixtureSampler(members(), weights, names, global_batch_size=16, micro_batch_size=16)
    assert "\n" not in str(info.value)


def test_members_must_share_the_context_length() -> None:
    other = WindowSampler(4000, T + 1, global_batch_size=8, micro_batch_size=8)
    with pytest.raises(UserInputError, match=r"context lengths \[16, 17\]"):
        MixtureSampler([*members()[:2], other], [1, 1, 1], NAMES, global_batch_size=16, micro_batch_size=16)


def test_upcoming_shards_cover_the_next_reads() -> None:
    sampler = MixtureSampler(
        members(block_shards=1), [0.5, 0.3, 0.2], NAMES, global_batch_size=16, micro_batch_size=16
    )
    batches = global_steps(sampler, 0, 100).reshape(-1, 2)
    located = [sampler.members[d].locate(np.array([s]))[0][0] for d, s in batches.tolist()]
    for k in range(0, 1600, 37):
        upcoming = sampler.upcoming_shards(k, 3)
        assert len(set(upcoming)) == 3
        # One shard per block: each member's current shard is needed right away, so those three come first.
        assert {(int(batches[j, 0]), int(located[j])) for j in range(k, k + 3)} <= set(upcoming)


def test_single_source_is_the_window_sampler_in_the_mixture_shape() -> None:
    sampler = WindowSampler(
        [3000, 0, 2000], T, global_batch_size=16, micro_batch_size=4, seed=5, block_shards=1
    )
    single = SingleSource(sampler)
    ids, starts = single.steps_starts(3, 7)
    assert np.array_equal(starts, sampler.steps_starts(3, 7)) and not ids.any()
    assert (single.accum_steps, single.micro_batch_size, single.global_batch_size) == (4, 4, 16)
    assert single.upcoming_shards(0, 2) == [(0, s) for s in sampler.upcoming_shards(0, 2)]
    state = single.state_dict(samples_consumed=48)
    assert state == sampler.state_dict(48)
    assert single.load_state_dict(state) == 3 == single.start_step
