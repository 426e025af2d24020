"""TokenWindowDataset / ValWindowDataset / TokenDataModule without a Trainer: exact tensors, exact order."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data import (
    DataConfig,
    PreparedData,
    TokenDataModule,
    TokenWindowDataset,
    ValWindowDataset,
    WindowSampler,
    load_prepared,
    prepare_dataset,
)
from gaudi3_scale.data.loader import gather_windows, val_budgets

T = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> PreparedData:
    return load_prepared(prepare_dataset(DataConfig(), tmp_path_factory.mktemp("ds"), progress=False))


def sampler_for(data: PreparedData, **kw: int) -> WindowSampler:
    args = {"global_batch_size": 8, "micro_batch_size": 2, "seed": 3} | kw
    return WindowSampler(len(data.train), T, **args)


def test_gather_windows_is_shift_by_one(data: PreparedData) -> None:
    starts = np.array([0, 17, len(data.train) - T - 1])
    x, y = gather_windows(data.train, starts, np.arange(T + 1))
    assert x.shape == y.shape == (3, T)
    assert x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    for row, start in enumerate(starts):
        assert x[row].tolist() == data.train[start : start + T].tolist()
        assert y[row].tolist() == data.train[start + 1 : start + T + 1].tolist()
    assert data.tokenizer.decode(x[0, :14].tolist()) == "First Citizen:"


def test_stream_yields_micro_steps_in_order(data: PreparedData) -> None:
    sampler = sampler_for(data)  # accum = 4
    batches = list(TokenWindowDataset(data.train, sampler, start_step=5, num_steps=2))
    assert len(batches) == 8
    expected = [sampler.micro_batch_starts(step, a) for step in (5, 6) for a in range(4)]
    for (x, _), starts in zip(batches, expected, strict=True):
        assert torch.equal(x[:, 0], torch.from_numpy(data.train[starts].astype(np.int64)))


def test_stream_is_the_same_across_sampler_chunks(
    data: PreparedData, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampler = sampler_for(data)  # accum 4 × micro 2: a 24-window chunk holds 3 steps
    monkeypatch.setattr("gaudi3_scale.data.loader._CHUNK_SAMPLES", 24)
    batches = list(TokenWindowDataset(data.train, sampler, start_step=2, num_steps=7))
    expected = [sampler.micro_batch_starts(step, a) for step in range(2, 9) for a in range(4)]
    assert len(batches) == len(expected)
    for (x, _), starts in zip(batches, expected, strict=True):
        assert torch.equal(x[:, 0], torch.from_numpy(data.train[starts].astype(np.int64)))


def test_workers_split_the_stream_without_duplicates(data: PreparedData) -> None:
    sampler = sampler_for(data, global_batch_size=6, micro_batch_size=2)  # accum 3: does not divide 2 workers
    dataset = TokenWindowDataset(data.train, sampler, start_step=1, num_steps=4)
    plain = [x for x, _ in DataLoader(dataset, batch_size=None, num_workers=0)]
    workers = [x for x, _ in DataLoader(dataset, batch_size=None, num_workers=2)]
    assert len(plain) == len(workers) == 12
    assert all(torch.equal(a, b) for a, b in zip(plain, workers, strict=True))


def test_pickling_reopens_the_memmap(data: PreparedData) -> None:
    dataset = TokenWindowDataset(data.train, sampler_for(data), num_steps=1)
    assert len(pickle.dumps(dataset)) < 20_000  # the path travels, not 2 MB of tokens
    clone = pickle.loads(pickle.dumps(dataset))
    assert isinstance(clone._members[0].shard(0), np.memmap)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(dataset, clone, strict=True))


def test_val_dataset_is_fixed(data: PreparedData) -> None:
    val = ValWindowDataset(data.val, T, micro_batch_size=4, max_batches=3)
    assert len(val) == 3
    x, y = val[2]
    assert x.shape == (4, T)
    start = int(val.starts[2][0])
    assert x[0].tolist() == data.val[start : start + T].tolist()
    assert torch.equal(ValWindowDataset(data.val, T, micro_batch_size=4, max_batches=3)[2][1], y)
    with pytest.raises(IndexError):
        val[3]


@pytest.mark.parametrize(
    ("max_batches", "weights", "budgets"),
    [(20, [7, 2, 1], [14, 4, 2]), (3, [1, 1], [2, 1]), (2, [3, 1], [1, 1]), (5, [7, 3], [4, 1]),
     (10, [100, 1, 1], [8, 1, 1]), (5, [1, 0, 1], [3, 0, 2]), (7, [1], [7]),
     (2, [1, 1, 1], [1, 1, 1]), (3, [100, 1, 1], [1, 1, 1])],
)  # fmt: skip
def test_val_budgets_split_exactly_with_one_batch_per_weighted_member(
    max_batches: int, weights: list[float], budgets: list[int]
) -> None:
    # exactly max_batches (the last two: one per weighted member, the fewest that validates each)
    assert val_budgets(max_batches, weights) == budgets


def test_mixture_val_set_holds_every_member(data: PreparedData) -> None:
    thirds = np.array_split(np.asarray(data.val), 3)
    val = ValWindowDataset(thirds, T, micro_batch_size=4, max_batches=2, weights=[1, 1, 1])
    assert len(val) == 3  # one batch of each member, in member order
    firsts = [x[0, 0].item() for x, _ in val]
    assert firsts == [int(third[int(starts[0])]) for third, starts in zip(thirds, val.starts, strict=True)]
    # 1:1 of 3 batches is 2 + 1, not 2 + 2: the Trainer's limit would cut the second member's last batch
    assert len(ValWindowDataset(thirds[:2], T, micro_batch_size=4, max_batches=3, weights=[1, 1])) == 3


@pytest.mark.parametrize(
    ("max_batches", "weights", "world", "per_member"),
    [(20, [7, 2, 1], 8, [11, 3, 2]), (20, [7, 2, 1], 2, [14, 4, 2]), (5, [1, 1], 2, [2, 2]), (7, [1], 2, [6]),
     (2, [1, 1, 1], 2, [2, 1, 1]), (1, [1, 1], 4, [1, 1])],
)  # fmt: skip
def test_data_parallel_ranks_share_out_one_processs_mixture_batches(
    max_batches: int, weights: list[float], world: int, per_member: list[int]
) -> None:
    """Each rank validates as many batches as the others, no two the same, each member by its weight, together
    the batches one process validates for the rounded budget (every rank all of them when there are fewer)."""
    members = [np.arange(5_000 + 1_000 * m, dtype=np.int64) * (m + 1) for m in range(len(weights))]
    ranks = [ValWindowDataset(members, T, micro_batch_size=2, max_batches=max_batches, world_size=world, rank=r,
                              weights=weights) for r in range(world)]  # fmt: skip
    assert len({len(rank) for rank in ranks}) == 1
    seen = [(m, tuple(starts), i) for rank in ranks for m, starts, i in rank._batches]
    if sum(per_member) >= world:
        assert len(seen) == len(set(seen)) == sum(per_member)
    else:
        assert len(seen) == world * sum(per_member)
    assert [sum(1 for m, _, _ in set(seen) if m == i) for i in range(len(weights))] == per_member
    one = ValWindowDataset(members, T, micro_batch_size=2, max_batches=sum(per_member), weights=weights)
    # the same batches, each with its place among one process's (what a masked-LM val batch's masks follow)
    assert set(seen) == {(m, tuple(starts), i) for m, starts, i in one._batches}


def test_a_member_with_a_short_val_split_is_never_left_out_on_several_ranks() -> None:
    """A member whose split holds fewer batches than its budget: what does not divide over the ranks is left out
    of the members with the most batches, never that member's last one."""
    members = [np.arange(20_000, dtype=np.int64), np.arange(3 * 2 * T + 1, dtype=np.int64)]  # 3 batches of 2
    for world in (2, 4, 8):
        ranks = [ValWindowDataset(members, T, micro_batch_size=2, max_batches=16, world_size=world, rank=r,
                                  weights=[1, 1]) for r in range(world)]  # fmt: skip
        assert len({len(rank) for rank in ranks}) == 1, world
        seen = {(m, tuple(starts)) for rank in ranks for m, starts, _ in rank._batches}
        assert len(seen) == sum(len(rank) for rank in ranks)  # no batch twice
        assert sorted({m for m, _ in seen}) == [0, 1] and sum(1 for m, _ in seen if m == 1) >= 1, world


def test_datamodule_without_trainer(data: PreparedData) -> None:
    dm = TokenDataModule(
        data, context_length=T, global_batch_size=8, micro_batch_size=2, seed=3, val_batches=2
    )
    dm.load_state_dict(sampler_for(data).state_dict(samples_consumed=16))  # before setup: checked in setup
    dm.setup("fit")
    assert (dm.start_step, dm.accum_steps) == (2, 4)
    first_x, _ = next(iter(dm.train_dataloader()))
    assert first_x[:, 0].tolist() == data.train[sampler_for(data).micro_batch_starts(2, 0)].tolist()
    assert len(dm.val_dataloader()) == 2
    assert dm.state_dict()["samples_consumed"] == 16


def test_datamodule_refuses_foreign_state(data: PreparedData) -> None:
    dm = TokenDataModule(
        data.directory, context_length=T, global_batch_size=8, micro_batch_size=2, seed=4, val_batches=1
    )
    dm.setup("fit")
    with pytest.raises(UserInputError, match="seed was 3, now 4"):
        dm.load_state_dict(sampler_for(data).state_dict(samples_consumed=8))


def test_datamodule_accepts_a_directory(data: PreparedData) -> None:
    dm = TokenDataModule(
        data.directory, context_length=T, global_batch_size=8, micro_batch_size=2, seed=3, val_batches=1
    )
    with pytest.raises(RuntimeError, match="setup"):
        dm.state_dict()
    dm.setup()
    assert dm.data.vocab_size == 65
