"""Ready-made micro-batches from token shards: one numpy gather per shard per batch, no per-sample collate.

`TokenWindowDataset` is the training stream: this rank's micro-batches in order (step ``start_step`` micro-steps
``0..accum-1``, then the next step, ...), which is the order Lightning consumes them with
``accumulate_grad_batches=accum``. `ValWindowDataset` is a fixed, map-style validation set. Both are used with
``DataLoader(batch_size=None)`` because every item already is a batch. With an `MlmMasking` (arch bert) a batch is
``(inputs, labels)`` of the window instead: masked by the sample's position in the stream (`data.mlm`).
"""

from __future__ import annotations

import mmap
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from gaudi3_scale.data.mixture import SingleSource, TrainSampler
from gaudi3_scale.data.mlm import TRAIN_STREAM, VAL_STREAM, MlmMasking
from gaudi3_scale.data.sampler import WindowSampler, rank_sample_positions
from gaudi3_scale.data.shards import ShardedTokens, val_window_starts_sharded

__all__ = ["TokenWindowDataset", "ValWindowDataset", "as_sharded", "gather_windows", "val_budgets"]

Batch = tuple[torch.Tensor, torch.Tensor]

_CHUNK_SAMPLES = 2048  # training windows the sampler computes per call (TokenWindowDataset)


def gather_windows(tokens: np.ndarray, starts: np.ndarray, offsets: np.ndarray) -> Batch:
    """``x, y = tokens[s : s+T], tokens[s+1 : s+T+1]`` for every start s, as int64 tensors [len(starts), T].

    `offsets` is ``np.arange(T + 1)``; one fancy-index gather reads all windows, then each half is converted to
    int64 in one contiguous copy (contiguous so that ``y.view(-1)`` works in the loss).
    """
    return _split(tokens[starts[:, None] + offsets])


def as_sharded(tokens: np.ndarray | ShardedTokens) -> ShardedTokens:
    """A flat token array (one shard, e.g. a memmap) or already sharded tokens, as `ShardedTokens`."""
    if isinstance(tokens, ShardedTokens):
        return tokens
    return ShardedTokens([len(tokens)], _ArrayOpener(tokens), dtype=tokens.dtype)


class _ArrayOpener:
    """One in-memory or memmapped array as shard 0; a file-backed memmap pickles as its path, not its content,
    so spawned DataLoader workers reopen it."""

    def __init__(self, tokens: np.ndarray) -> None:
        self._tokens = tokens

    def __call__(self, index: int) -> np.ndarray:
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:
        tokens = self._tokens
        if isinstance(tokens, np.memmap) and isinstance(tokens.base, mmap.mmap) and tokens.filename:
            return {"_tokens": ("memmap", tokens.filename, tokens.dtype.str, tokens.offset, tokens.shape)}
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        ref = state["_tokens"]
        if isinstance(ref, tuple) and ref[0] == "memmap":
            _, filename, dtype, offset, shape = ref
            ref = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=shape)
        self._tokens = ref


class TokenWindowDataset(IterableDataset[Batch]):
    """This rank's training micro-batches ``(x, y)``, int64 [micro, T], from optimizer step `start_step` on.

    `tokens` is one dataset's train split (a flat array or `ShardedTokens`) for a `WindowSampler`, or one per
    member for a `MixtureSampler`. Infinite unless `num_steps` is given. With DataLoader workers, worker w of W
    builds micro-batches j ≡ w (mod W) (j counted from the first one); DataLoader collects them round-robin, so the
    stream is the same as with no workers and no batch is built twice. Each time the sampler is asked for more
    steps, the shards it will read next are hinted to the tokens (a URL dataset fetches them ahead). Steps in
    `skipped` are passed over (`start_step` and the steps are data steps: global batch indices of the stream).
    """

    def __init__(
        self,
        tokens: np.ndarray | ShardedTokens | Sequence[np.ndarray | ShardedTokens],
        sampler: WindowSampler | TrainSampler,
        *,
        start_step: int = 0,
        num_steps: int | None = None,
        prefetch_shards: int = 0,
        masking: MlmMasking | None = None,
        skipped: Collection[int] = (),
    ) -> None:
        self._members = _members(tokens)
        self.sampler: TrainSampler = SingleSource(sampler) if isinstance(sampler, WindowSampler) else sampler
        if [m.shard_tokens for m in self._members] != [list(m.shard_tokens) for m in self.sampler.members]:
            raise ValueError("the sampler was built for other shards than the tokens given")
        self.start_step = start_step
        self.num_steps = num_steps
        self.prefetch_shards = prefetch_shards
        self.masking = masking
        self.skipped = frozenset(skipped)  # data steps never loaded (`data.skips.BatchSkips.skipped`)
        self._offsets = np.arange(self.sampler.context_length + 1, dtype=np.int64)
        self._hints = any(m.fetches for m in self._members)  # local shards need no prefetch hints
        # The blocks in use and the next ones, plus the prefetch depth: what a fetching cache should hold next.
        self._hint_count = sum(m.block_shards for m in self.sampler.members) * 2 + prefetch_shards

    def _hint(self, step: int) -> None:
        ahead = self.sampler.upcoming_shards(step * self.sampler.global_batch_size, self._hint_count)
        by_member: dict[int, list[int]] = {}
        for member, shard in ahead:
            by_member.setdefault(member, []).append(shard)
        for member, shards in by_member.items():
            self._members[member].prefetch(shards)

    def batch(self, members: np.ndarray, starts: np.ndarray) -> Batch:
        if len(self._members) == 1:
            windows = self._members[0].gather(starts, self._offsets)
        else:
            windows = np.empty((len(starts), len(self._offsets)), dtype=np.int64)
            for member in np.unique(members).tolist():
                sel = members == member
                windows[sel] = self._members[member].gather(starts[sel], self._offsets)
        return _split(windows)

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        sampler = self.sampler
        accum = sampler.accum_steps
        # Window offsets for many steps per sampler call: one call per step cost ~35 µs on a 12-sequence batch.
        chunk = max(1, _CHUNK_SAMPLES // (accum * sampler.micro_batch_size))
        end = None if self.num_steps is None else self.start_step + self.num_steps
        step, index = self.start_step, 0
        chunk_first = step
        members = starts = np.empty((0, accum, sampler.micro_batch_size), dtype=np.int64)
        while end is None or step < end:
            if step in self.skipped:  # not in the stream at all: no worker builds it, the round-robin holds
                step += 1
                continue
            mine = [a for a in range(accum) if (index + a) % num_workers == worker]
            if mine:
                if step - chunk_first >= len(starts):
                    count = chunk if end is None else min(chunk, end - step)
                    chunk_first = step
                    members, starts = self.sampler.steps_starts(step, count)
                if self._hints:
                    self._hint(step)  # every step: a block boundary may fall anywhere in a chunk
                for a in mine:
                    batch = self.batch(members[step - chunk_first, a], starts[step - chunk_first, a])
                    yield batch if self.masking is None else self._masked(batch, step, a)
            step, index = step + 1, index + accum

    def _masked(self, batch: Batch, step: int, micro_step: int) -> Batch:
        s = self.sampler
        positions = rank_sample_positions(
            np.array([step]),
            np.array([micro_step]),
            global_batch_size=s.global_batch_size,
            micro_batch_size=s.micro_batch_size,
            world_size=s.world_size,
            rank=s.rank,
        )
        assert self.masking is not None
        return self.masking.apply(batch[0], positions.reshape(-1), stream=TRAIN_STREAM)


def _split(windows: np.ndarray) -> Batch:
    """[n, T+1] windows → x, y int64 [n, T], each one contiguous copy (so ``y.view(-1)`` works in the loss)."""
    x = torch.from_numpy(windows[:, :-1].astype(np.int64, order="C"))
    y = torch.from_numpy(windows[:, 1:].astype(np.int64, order="C"))
    return x, y


class ValWindowDataset(Dataset[Batch]):
    """The fixed validation batches of this rank: `val_window_starts_sharded` over each dataset's val shards.

    With several datasets (a mixture) the `max_batches` budget is split by weight (`val_budgets`: exactly
    `max_batches`, each member with a positive weight getting at least one batch); every batch comes from one member.
    With several data-parallel ranks the budget is first rounded to a multiple of them (`_divisible_batches`) and
    the batches one process would validate are shared out (`_rank_share`): together the ranks validate them.
    """

    def __init__(
        self,
        tokens: np.ndarray | ShardedTokens | Sequence[np.ndarray | ShardedTokens],
        context_length: int,
        *,
        micro_batch_size: int,
        max_batches: int,
        world_size: int = 1,
        rank: int = 0,
        weights: Sequence[float] | None = None,
        masking: MlmMasking | None = None,
    ) -> None:
        self._members = _members(tokens)
        self.masking = masking
        self._micro = micro_batch_size
        weights = weights or [1.0] * len(self._members)
        budgets = val_budgets(_divisible_batches(max_batches, weights, world_size), weights)
        whole: list[list[_ValBatch]] = []  # each member's batches, as one process validates them
        for m, (member, budget) in enumerate(zip(self._members, budgets, strict=True)):
            if budget == 0:
                continue
            rows = val_window_starts_sharded(
                member.shard_tokens, context_length, micro_batch_size=micro_batch_size, max_batches=budget
            )
            first = sum(len(batches) for batches in whole)
            whole.append([(m, row, first + i) for i, row in enumerate(rows)])
        self._batches = _rank_share(whole, world_size, rank)
        self._offsets = np.arange(context_length + 1, dtype=np.int64)

    @property
    def starts(self) -> list[np.ndarray]:
        return [row for _, row, _ in self._batches]

    def __len__(self) -> int:
        return len(self._batches)

    def __getitem__(self, index: int) -> Batch:
        if not 0 <= index < len(self._batches):
            raise IndexError(f"validation batch {index} out of range [0, {len(self._batches)})")
        member, starts, whole_index = self._batches[index]
        batch = _split(self._members[member].gather(starts, self._offsets))
        if self.masking is None:
            return batch
        # Fixed masks: the same at every evaluation, so val loss and accuracy compare across steps, and the same
        # on any number of ranks (by the batch's place among one process's batches).
        positions = whole_index * self._micro + np.arange(len(starts), dtype=np.int64)
        return self.masking.apply(batch[0], positions, stream=VAL_STREAM)


def _divisible_batches(max_batches: int, weights: Sequence[float], world_size: int) -> int:
    """The validation batches of a mixture (at least one per weighted member, `val_budgets`) rounded to a multiple
    of the data-parallel ranks, so that each runs the same number and none is left out: down, unless that leaves a
    member out, then up. Fewer than the ranks in all: as many (every rank runs them all, `_rank_share`)."""
    members = sum(1 for w in weights if w > 0)
    total = max(max_batches, members)
    if world_size == 1 or total < world_size:
        return total
    total -= total % world_size
    return total if total >= members else -(-members // world_size) * world_size


# a validation batch: (member, its windows' starts, its index among the batches one process validates)
_ValBatch = tuple[int, np.ndarray, int]


def _rank_share(members: list[list[_ValBatch]], world_size: int, rank: int) -> list[_ValBatch]:
    """This rank's share of the members' validation batches, every rank the same number, together one process's
    batches: every world-th of each member's world-divisible prefix, then every world-th of the members'
    remainders pooled. When the batches do not divide (a member's val split held fewer windows than its budget),
    the few too many are left out of the members with the most batches, never a member's last one. With fewer
    batches in all than ranks, every rank runs them all (as `sampler.val_window_starts`). One member: exactly
    `val_window_starts`'s split (the last of its batches left out)."""
    total = sum(len(batches) for batches in members)
    if world_size == 1 or total < world_size:
        return [batch for batches in members for batch in batches]
    kept = [len(batches) for batches in members]
    for _ in range(total % world_size):
        larger = [m for m, n in enumerate(kept) if n > 1]
        m = max(larger or [m for m, n in enumerate(kept) if n], key=lambda m: (kept[m], -m))
        kept[m] -= 1
    mine: list[_ValBatch] = []
    pooled: list[_ValBatch] = []
    for batches, n in zip(members, kept, strict=True):
        even = n - n % world_size
        mine += batches[:even][rank::world_size]
        pooled += batches[even:n]
    return mine + pooled[rank::world_size]


def _members(
    tokens: np.ndarray | ShardedTokens | Sequence[np.ndarray | ShardedTokens],
) -> list[ShardedTokens]:
    if isinstance(tokens, np.ndarray | ShardedTokens):
        return [as_sharded(tokens)]
    return [as_sharded(t) for t in tokens]


def val_budgets(max_batches: int, weights: Sequence[float]) -> list[int]:
    """Validation batches per member: `max_batches` split by weight, exactly (largest-remainder rounding).

    Every member with a positive weight gets at least one batch, so fewer `max_batches` than such members give
    one batch each (more than asked: a member left out would be missing from val/loss without a word). A member
    whose share is under one batch is held at one and the rest is split over the others again.
    """
    positive = [m for m, w in enumerate(weights) if w > 0]
    total = max(max_batches, len(positive))
    held: list[int] = []  # at one batch
    while True:
        free = [m for m in positive if m not in held]
        seats = total - len(held)
        quotas = {m: seats * weights[m] / sum(weights[f] for f in free) for m in free}
        under = [m for m, q in quotas.items() if q < 1]
        if not under:
            break
        held += under
    budgets = [1 if m in held else int(quotas.get(m, 0)) for m in range(len(weights))]
    # the seats left go to the largest remainders (ties: the heavier member, then the earlier one)
    by_remainder = sorted(quotas, key=lambda m: (budgets[m] - quotas[m], -weights[m], m))
    for m in by_remainder[: total - sum(budgets)]:
        budgets[m] += 1
    return budgets
