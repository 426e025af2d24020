"""Ready-made micro-batches from token memmaps: one numpy gather per batch, no per-sample collate.

`TokenWindowDataset` is the training stream: this rank's micro-batches in order (step ``start_step`` micro-steps
``0..accum-1``, then the next step, ...), which is the order Lightning consumes them with
``accumulate_grad_batches=accum``. `ValWindowDataset` is a fixed, map-style validation set. Both are used with
``DataLoader(batch_size=None)`` because every item already is a batch.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from gaudi3_scale.data.sampler import WindowSampler, val_window_starts

__all__ = ["TokenWindowDataset", "ValWindowDataset", "gather_windows"]

Batch = tuple[torch.Tensor, torch.Tensor]

_CHUNK_SAMPLES = 2048  # training windows the sampler computes per call (TokenWindowDataset)


def gather_windows(tokens: np.ndarray, starts: np.ndarray, offsets: np.ndarray) -> Batch:
    """``x, y = tokens[s : s+T], tokens[s+1 : s+T+1]`` for every start s, as int64 tensors [len(starts), T].

    `offsets` is ``np.arange(T + 1)``; one fancy-index gather reads all windows, then each half is converted to
    int64 in one contiguous copy (contiguous so that ``y.view(-1)`` works in the loss).
    """
    windows = tokens[starts[:, None] + offsets]
    x = torch.from_numpy(windows[:, :-1].astype(np.int64, order="C"))
    y = torch.from_numpy(windows[:, 1:].astype(np.int64, order="C"))
    return x, y


class _MemmapPickling:
    """Pickle a file-backed memmap as its path, not its content, so spawned DataLoader workers reopen it."""

    _tokens: np.ndarray

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        tokens = self._tokens
        if isinstance(tokens, np.memmap) and isinstance(tokens.base, mmap.mmap) and tokens.filename:
            state["_tokens"] = ("memmap", tokens.filename, tokens.dtype.str, tokens.offset, tokens.shape)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        ref = state["_tokens"]
        if isinstance(ref, tuple) and ref[0] == "memmap":
            _, filename, dtype, offset, shape = ref
            state["_tokens"] = np.memmap(
                filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=shape
            )
        self.__dict__.update(state)


class TokenWindowDataset(_MemmapPickling, IterableDataset[Batch]):
    """This rank's training micro-batches ``(x, y)``, int64 [micro, T], from optimizer step `start_step` on.

    Infinite unless `num_steps` is given. With DataLoader workers, worker w of W builds micro-batches j ≡ w (mod W)
    (j counted from the first one); DataLoader collects them round-robin, so the stream is the same as with no
    workers and no batch is built twice.
    """

    def __init__(
        self, tokens: np.ndarray, sampler: WindowSampler, *, start_step: int = 0, num_steps: int | None = None
    ) -> None:
        if len(tokens) != sampler.num_tokens:
            raise ValueError(
                f"sampler was built for {sampler.num_tokens} tokens, got an array of {len(tokens)}"
            )
        self._tokens = tokens
        self.sampler = sampler
        self.start_step = start_step
        self.num_steps = num_steps
        self._offsets = np.arange(sampler.context_length + 1, dtype=np.int64)

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        sampler = self.sampler
        accum = sampler.accum_steps
        # Window offsets for many steps per sampler call: one call per step cost ~35 µs on a 12-sequence batch.
        chunk = max(1, _CHUNK_SAMPLES // (accum * sampler.micro_batch_size))
        end = None if self.num_steps is None else self.start_step + self.num_steps
        step, index = self.start_step, 0
        chunk_first, starts = step, np.empty((0, accum, sampler.micro_batch_size), dtype=np.int64)
        while end is None or step < end:
            mine = [a for a in range(accum) if (index + a) % num_workers == worker]
            if mine:
                if step - chunk_first >= len(starts):
                    count = chunk if end is None else min(chunk, end - step)
                    chunk_first, starts = step, sampler.steps_starts(step, count)
                for a in mine:
                    yield gather_windows(self._tokens, starts[step - chunk_first, a], self._offsets)
            step, index = step + 1, index + accum


class ValWindowDataset(_MemmapPickling, Dataset[Batch]):
    """The fixed validation batches of this rank (see `val_window_starts`)."""

    def __init__(
        self,
        tokens: np.ndarray,
        context_length: int,
        *,
        micro_batch_size: int,
        max_batches: int,
        world_size: int = 1,
        rank: int = 0,
    ) -> None:
        self._tokens = tokens
        self.starts = val_window_starts(
            len(tokens),
            context_length,
            micro_batch_size=micro_batch_size,
            max_batches=max_batches,
            world_size=world_size,
            rank=rank,
        )
        self._offsets = np.arange(context_length + 1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> Batch:
        if not 0 <= index < len(self.starts):
            raise IndexError(f"validation batch {index} out of range [0, {len(self.starts)})")
        return gather_windows(self._tokens, self.starts[index], self._offsets)
