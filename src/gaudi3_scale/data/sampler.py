"""Which training windows each rank reads at each step: a deterministic, resumable, rank-aware stream.

Shards and windows. A split is a list of shards holding ``t_j`` tokens each (a single file is one shard). Window
``i`` of shard ``j`` is ``shard_j[i*stride : i*stride + T + 1]`` (x = the first T tokens, y = the same shifted by
one); shard ``j`` has ``n_j = max(0, (t_j - T - 1) // stride + 1)`` windows and no window crosses a shard boundary.
Starts are *virtual offsets* into the concatenation of the shards, ``base_j + i*stride`` with ``base_j = t_0 + … +
t_{j-1}`` (`shard_bases`; `locate` maps them back to (shard, local offset)). ``stride=1`` uses every offset, like
nanoGPT's random offsets, but without replacement within an epoch.

Order. An infinite global stream of epochs of ``N = sum(n_j)`` windows. Epoch ``e`` permutes the shards that hold
windows (a permutation keyed by ``(seed, e, 1)``) and cuts that order into blocks of `block_shards` shards; it
visits block 0's windows, then block 1's, …, and shuffles the windows within a block (the block's shards
concatenated in their epoch order) by a permutation keyed by ``(seed, e)`` and the block. Reads stay local: between
two block boundaries only one block's shards are touched, which is what a shard cache smaller than the dataset
needs. With one block (the default) and one shard this is exactly the single-file stream: global sample ``k`` is
window ``perm_{k // N}(k % N)``.

Permutations are 4-round Feistel networks over the smallest even-bit power-of-two domain ``2^(2h) >= n`` (Luby &
Rackoff 1988: four rounds of a pseudo-random function make a strong pseudo-random permutation), restricted to
``[0, n)`` by cycle walking (Black & Rogaway 2002: re-apply until the value lands in range; it always does, since
the cycle through an in-range value comes back to it). The domain is < 4n, so a walk takes < 4 applications on
average. O(1) memory, vectorized in numpy: billions of windows are fine; an epoch's shard order costs O(shards).

Global batches. Optimizer step ``s`` consumes samples ``[s*G, (s+1)*G)``, ``G = global_batch_size``. Micro-step
``a`` on data-parallel rank ``r`` takes the ``micro`` samples starting at ``s*G + (a*world + r)*micro``, with
``G = micro * accum * world``. Which samples make up a step is independent of world size and accumulation, so
resuming on another world size with the same ``G`` continues the very same stream.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from gaudi3_scale.config.core import check_positive
from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.distributed.plan import BatchPlan

__all__ = [
    "SAMPLER_STATE_FORMAT",
    "WindowSampler",
    "accumulation_steps",
    "feistel_permute",
    "rank_sample_positions",
    "val_window_starts",
]

SAMPLER_STATE_FORMAT = "gaudi3-scale/window-sampler/2"
_SAMPLER_STATE_FORMAT_V1 = "gaudi3-scale/window-sampler/1"  # single-file datasets; resumable on one shard
_ROUNDS = 4
# splitmix64's finalizer constants (Steele, Lea & Flood 2014): a cheap 64-bit mix used as the round function.
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(
    0x9E3779B97F4A7C15
)  # splitmix64's increment: block b's keys are mix64(base + (b+1)*golden)
_U64 = (1 << 64) - 1
# Cycle walking ends in a long tail of a few values (a domain up to 4n leaves 1 in 4 outside after each walk, so
# 2,048 values take ~20 walks); below this many values left, Python ints finish sooner than numpy (~25 calls a walk).
_PYTHON_WALK = 32
_EPOCH_PLANS_KEPT = 3  # a batch spans at most a few epochs except on tiny datasets, which are cheap to plan


def accumulation_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-steps per optimizer step: ``G / (micro * world)``, which must be a whole number (`BatchPlan`)."""
    return BatchPlan.build(
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        data_parallel_size=world_size,
    ).accumulation


def rank_sample_positions(
    steps: np.ndarray,
    micro_steps: np.ndarray,
    *,
    global_batch_size: int,
    micro_batch_size: int,
    world_size: int,
    rank: int,
) -> np.ndarray:
    """Global stream positions of a rank's micro-batches, shape [len(steps), len(micro_steps), micro]."""
    first = steps[:, None] * global_batch_size + (micro_steps[None, :] * world_size + rank) * micro_batch_size
    return first[..., None] + np.arange(micro_batch_size, dtype=np.int64)


@lru_cache(maxsize=16)
def _round_keys(seed: int, epoch: int) -> tuple[np.uint64, ...]:
    return tuple(np.random.SeedSequence([seed, epoch]).generate_state(_ROUNDS, dtype=np.uint64))


def _seed_words(*words: int) -> np.ndarray:
    return np.random.SeedSequence(list(words)).generate_state(_ROUNDS, dtype=np.uint64)


def _mix64(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> 30)) * _M1  # uint64 arrays wrap around on overflow, which is what a hash wants
    x = (x ^ (x >> 27)) * _M2
    return x ^ (x >> 31)


def _half_bits(n: np.ndarray) -> np.ndarray:
    """``max(1, ((n - 1).bit_length() + 1) // 2)`` of every element (n >= 1), as uint64."""
    m = np.asarray(n, dtype=np.uint64) - np.uint64(1)
    # frexp's exponent is the bit length, or one more where m rounded up to a power of two as a float.
    exponent = np.frexp(m.astype(np.float64))[1].astype(np.uint64)
    too_big = (exponent > 0) & ((np.uint64(1) << (exponent - (exponent > 0))) > m)
    return np.maximum((exponent - too_big + np.uint64(1)) // np.uint64(2), np.uint64(1))


def _mix64_int(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def _walk_int(x: int, n: int, keys: list[int], shift: int) -> int:
    """Cycle walking of one value with Python ints: the numpy path's arithmetic, bit for bit."""
    mask = (1 << shift) - 1
    while x >= n:
        left, right = x >> shift, x & mask
        for key in keys:
            left, right = right, left ^ (_mix64_int(right ^ key) & mask)
        x = (left << shift) | right
    return x


def _feistel(x: np.ndarray, n: Any, keys: np.ndarray, half_bits: Any) -> np.ndarray:
    """The Feistel permutation of ``[0, n)`` applied to uint64 `x`.

    `n` and `half_bits` are scalars or arrays like `x`, `keys` is [rounds] or [rounds, len(x)]: one call permutes
    values that belong to different domains (the blocks of an epoch) at once.
    """
    per_element = keys.ndim == 2
    shift = np.asarray(half_bits, dtype=np.uint64)
    mask = (np.uint64(1) << shift) - np.uint64(1)
    bound = np.asarray(n, dtype=np.uint64)

    def permute_domain(x: np.ndarray, keys: np.ndarray, shift: np.ndarray, mask: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for key in keys:
            left, right = right, left ^ (_mix64(right ^ key) & mask)
        return (left << shift) | right

    out = permute_domain(x, keys, shift, mask)
    pending = np.flatnonzero(out >= bound)
    while pending.size:  # cycle walking, only on the values still outside [0, n)
        if pending.size <= _PYTHON_WALK:
            for i in pending.tolist():
                if per_element:
                    args = (int(bound[i]), keys[:, i].tolist(), int(shift[i]))
                else:
                    args = (int(bound), keys.tolist(), int(shift))
                out[i] = _walk_int(int(out[i]), *args)
            break
        if per_element:
            walked = permute_domain(out[pending], keys[:, pending], shift[pending], mask[pending])
            out[pending] = walked
            pending = pending[walked >= bound[pending]]
        else:
            walked = permute_domain(out[pending], keys, shift, mask)
            out[pending] = walked
            pending = pending[walked >= bound]
    return out.astype(np.int64)


def feistel_permute(indices: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Apply the (seed, epoch) pseudo-random permutation of ``[0, n)`` to `indices` (each in ``[0, n)``)."""
    keys = np.array(_round_keys(seed, epoch), dtype=np.uint64)
    return _feistel(np.asarray(indices, dtype=np.uint64), n, keys, _half_bits(np.array(n)))


@dataclass(frozen=True)
class _EpochPlan:
    """One epoch's visiting order. Positions count windows from the epoch's start, before the in-block shuffle."""

    shards: np.ndarray  # int64 [L]: the shards that hold windows, in visiting order
    shard_first: np.ndarray  # int64 [L]: position of each visited shard's first window
    block_first: np.ndarray  # int64 [B]: position of each block's first window
    block_windows: np.ndarray  # uint64 [B]
    block_half_bits: np.ndarray  # uint64 [B]
    key_base: np.ndarray  # uint64 [rounds]: block b's round keys are mix64(key_base + (b + 1) * golden)


def _block_keys(plan: _EpochPlan, blocks: np.ndarray) -> np.ndarray:
    """Round keys of `blocks` (int64 array), [rounds, len(blocks)]."""
    counters = (blocks.astype(np.uint64) + np.uint64(1)) * _GOLDEN  # arrays wrap silently, scalars would warn
    return _mix64(plan.key_base[:, None] + counters[None, :])


def _tokens_digest(shard_tokens: np.ndarray) -> str:
    """sha256 of the token counts as little-endian int64: names a sharded dataset's layout in a checkpoint."""
    return hashlib.sha256(shard_tokens.astype("<i8").tobytes()).hexdigest()


class WindowSampler:
    """Virtual token start offsets of the windows this rank reads, per optimizer step and micro-step."""

    def __init__(
        self,
        shard_tokens: Sequence[int] | int,
        context_length: int,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
        stride: int = 1,
        block_shards: int | None = None,
        allow_data_change: bool = False,
    ) -> None:
        for name, value in (
            ("context_length", context_length),
            ("global_batch_size", global_batch_size),
            ("micro_batch_size", micro_batch_size),
            ("world_size", world_size),
            ("stride", stride),
            ("block_shards", block_shards),
        ):
            check_positive(name, value)
        check_positive("seed", seed, allow_zero=True)
        if not 0 <= rank < world_size:
            raise ConfigError("rank", f"must be in [0, world_size={world_size}), got {rank}")
        tokens = np.atleast_1d(np.asarray(shard_tokens))
        if tokens.ndim != 1 or (tokens.size and (tokens.dtype.kind not in "iu" or (tokens < 0).any())):
            raise UserInputError(f"shard token counts must be integers >= 0, got {brief(shard_tokens)}")
        self.shard_tokens = tokens = tokens.astype(np.int64)
        self.shard_bases = np.concatenate([[0], np.cumsum(tokens)[:-1]]).astype(np.int64)
        self.shard_windows = np.maximum(0, (tokens - context_length - 1) // stride + 1)
        self.num_tokens, self.num_shards = int(tokens.sum()), len(tokens)
        self.num_windows = int(self.shard_windows.sum())
        if self.num_windows == 0:
            raise UserInputError(_no_windows_message(self.num_tokens, self.num_shards, context_length))
        self._window_bases = np.concatenate([[0], np.cumsum(self.shard_windows)[:-1]]).astype(np.int64)
        self._live_shards = np.flatnonzero(self.shard_windows).astype(np.int64)
        live = len(self._live_shards)
        self.block_shards = live if block_shards is None else min(block_shards, live)
        self.num_blocks = -(-live // self.block_shards)
        self.shard_tokens_sha256 = _tokens_digest(tokens)
        self.context_length, self.stride, self.seed = context_length, stride, seed
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.world_size, self.rank = world_size, rank
        self.accum_steps = accumulation_steps(global_batch_size, micro_batch_size, world_size)
        self.start_step = 0
        # train.allow_data_change: a checkpoint of other tokens resumes at its position in this stream's order
        self.allow_data_change = allow_data_change
        self._plans: dict[int, _EpochPlan] = {}

    def _plan(self, epoch: int) -> _EpochPlan:
        plan = self._plans.get(epoch)
        if plan is None:
            if len(self._plans) >= _EPOCH_PLANS_KEPT:
                del self._plans[min(self._plans)]
            plan = self._plans[epoch] = self._build_plan(epoch)
        return plan

    def _build_plan(self, epoch: int) -> _EpochPlan:
        """O(shards) numpy: the epoch's shard order, its blocks, and each block's permutation keys."""
        live = len(self._live_shards)
        order = _feistel(
            np.arange(live, dtype=np.uint64),
            live,
            _seed_words(self.seed, epoch, 1),  # not (seed, epoch): the shard order has keys of its own
            _half_bits(np.array(live)),
        )
        shards = self._live_shards[order]
        shard_first = np.concatenate([[0], np.cumsum(self.shard_windows[shards])[:-1]]).astype(np.int64)
        block_first = shard_first[:: self.block_shards]
        block_windows = np.diff(np.append(block_first, self.num_windows)).astype(np.uint64)
        if self.num_blocks == 1:  # exactly the single-file permutation of the epoch
            key_base = np.array(_round_keys(self.seed, epoch), dtype=np.uint64)
        else:  # derived per block on use (splitmix64's stream), not stored: 100k blocks would be 3 MB an epoch
            key_base = _seed_words(self.seed, epoch, 2)
        return _EpochPlan(
            shards, shard_first, block_first, block_windows, _half_bits(block_windows), key_base
        )

    def _epoch_windows(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, window index within the shard) of epoch positions."""
        plan = self._plan(epoch)
        if self.num_blocks == 1:  # the default: one shuffle over the whole epoch
            visited = _feistel(
                positions.astype(np.uint64), self.num_windows, plan.key_base, plan.block_half_bits[0]
            )
        else:
            block = np.searchsorted(plan.block_first, positions, side="right") - 1
            first = plan.block_first[block]
            within = (positions - first).astype(np.uint64)
            if (block == block[0]).all():  # the usual case: a batch inside one block
                b = block[:1]
                keys, n, half_bits = (
                    _block_keys(plan, b)[:, 0],
                    plan.block_windows[b[0]],
                    plan.block_half_bits[b[0]],
                )
            else:
                keys, n, half_bits = (
                    _block_keys(plan, block),
                    plan.block_windows[block],
                    plan.block_half_bits[block],
                )
            visited = first + _feistel(within, n, keys, half_bits)
        if len(plan.shards) == 1:
            return np.full_like(visited, plan.shards[0]), visited
        ordinal = np.searchsorted(plan.shard_first, visited, side="right") - 1
        return plan.shards[ordinal], visited - plan.shard_first[ordinal]

    def _shard_windows_of(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global stream positions → (shard, window index within the shard)."""
        samples = np.asarray(samples, dtype=np.int64)
        if samples.size == 0:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        epochs, positions = np.divmod(samples, self.num_windows)
        first, last = int(epochs.min()), int(epochs.max())
        if first == last:  # the usual case: a batch inside one epoch
            return self._epoch_windows(first, positions)
        shards, windows = np.empty_like(positions), np.empty_like(positions)
        for epoch in range(first, last + 1):
            sel = epochs == epoch
            if sel.any():  # a rank's samples can skip a whole epoch of a tiny dataset
                shards[sel], windows[sel] = self._epoch_windows(epoch, positions[sel])
        return shards, windows

    def window_indices(self, samples: np.ndarray) -> np.ndarray:
        """Global stream positions → window ids (shard-major over all shards' windows)."""
        shards, windows = self._shard_windows_of(samples)
        return self._window_bases[shards] + windows

    def sample_starts(self, samples: np.ndarray) -> np.ndarray:
        """Global stream positions → virtual token start offsets (same shape)."""
        samples = np.asarray(samples, dtype=np.int64)
        shards, windows = self._shard_windows_of(samples.ravel())
        return (self.shard_bases[shards] + windows * self.stride).reshape(samples.shape)

    def locate(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Virtual start offsets → (shard index, offset within that shard), both int64 like `starts`."""
        starts = np.asarray(starts, dtype=np.int64)
        # side="right": a shard with 0 tokens shares its base with the next one, which is the one that holds it.
        shards = np.searchsorted(self.shard_bases, starts, side="right") - 1
        return shards, starts - self.shard_bases[shards]

    def upcoming_shards(self, first_sample: int, count: int) -> list[int]:
        """The next `count` distinct shards read from global sample `first_sample` on, for prefetching.

        Block by block: the shards of the block holding `first_sample` (in the epoch's shard order), then the next
        block's, crossing into the next epoch. A block's windows are shuffled together, so its shards are all
        needed from its first sample on; no shard of a later block is read before the current block ends.
        """
        return [shard for shard, _ in self.upcoming_shard_positions(first_sample, count)]

    def upcoming_shard_positions(self, first_sample: int, count: int) -> list[tuple[int, int]]:
        """`upcoming_shards` with the stream position each shard is first needed by (its block's first sample,
        or `first_sample` for the current block)."""
        count = min(count, len(self._live_shards))
        epoch, position = divmod(first_sample, self.num_windows)
        plan = self._plan(epoch)
        block = int(np.searchsorted(plan.block_first, position, side="right")) - 1
        out: list[tuple[int, int]] = []
        seen: set[int] = set()
        while len(out) < count:
            needed = max(first_sample, epoch * self.num_windows + int(plan.block_first[block]))
            for shard in plan.shards[block * self.block_shards : (block + 1) * self.block_shards].tolist():
                if shard not in seen and len(out) < count:
                    seen.add(shard)
                    out.append((shard, needed))
            block += 1
            if block == self.num_blocks:
                epoch, block = epoch + 1, 0
                plan = self._plan(epoch)
        return out

    def _samples(self, steps: np.ndarray, micro_steps: np.ndarray) -> np.ndarray:
        return rank_sample_positions(
            steps,
            micro_steps,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            world_size=self.world_size,
            rank=self.rank,
        )

    def step_starts(self, step: int) -> np.ndarray:
        """Token offsets for every micro-step of `step` on this rank, shape [accum, micro] (one vectorized call)."""
        return self.steps_starts(step, 1)[0]

    def steps_starts(self, first_step: int, num_steps: int) -> np.ndarray:
        """`step_starts` of steps ``first_step .. first_step + num_steps - 1``, shape [steps, accum, micro].

        One vectorized call for many steps: the permutation costs some 50 numpy calls whatever the array size, so
        on a small batch that is ~35 µs per step one step at a time and < 1 µs per step 2,048 samples at a time.
        """
        steps = np.arange(first_step, first_step + num_steps, dtype=np.int64)
        return self.sample_starts(self._samples(steps, np.arange(self.accum_steps, dtype=np.int64)))

    def micro_batch_starts(self, step: int, micro_step: int) -> np.ndarray:
        if not 0 <= micro_step < self.accum_steps:
            raise ValueError(f"micro_step must be in [0, {self.accum_steps}), got {micro_step}")
        one_step, one_micro = np.array([step], dtype=np.int64), np.array([micro_step], dtype=np.int64)
        return self.sample_starts(self._samples(one_step, one_micro)[0, 0])

    def state_dict(self, samples_consumed: int) -> dict[str, Any]:
        return {
            "format": SAMPLER_STATE_FORMAT,
            "seed": self.seed,
            "stride": self.stride,
            "num_windows": self.num_windows,
            "context_length": self.context_length,
            "num_shards": self.num_shards,
            "block_shards": self.block_shards,
            "shard_tokens_sha256": self.shard_tokens_sha256,
            "global_batch_size": self.global_batch_size,  # informational: resuming needs only the sample count
            "samples_consumed": samples_consumed,
        }

    def check_same_stream(
        self, state: Mapping[str, Any], where: str = "checkpoint data-sampler state"
    ) -> int:
        """Refuse a state that belongs to another data stream; return its samples_consumed.

        With `allow_data_change` the data may be other tokens (shards, counts, windows: what `gaudi3 prepare`
        makes of changed text): the position, `samples_consumed`, is then taken in this stream's order, wrapping
        its epochs. How windows are cut and ordered (context_length, stride, seed, block size) must still match;
        a block of all the changed data's shards (a local dataset's default, or a block larger than the data)
        passes."""
        found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        keys = ["seed", "stride", "context_length", "num_shards", "block_shards", "num_windows"]
        if found == _SAMPLER_STATE_FORMAT_V1 and isinstance(state, Mapping):
            state = {**state, "num_shards": 1, "block_shards": 1}  # one file: one shard in one block
        elif found == SAMPLER_STATE_FORMAT and isinstance(state, Mapping):
            keys.append("shard_tokens_sha256")
        else:
            raise UserInputError(f"{where}: format {brief(found)} is not {SAMPLER_STATE_FORMAT!r}")
        if self.allow_data_change:
            keys = [k for k in keys if k not in _DATA_KEYS]
            # a block of all the shards then, or more than the changed data has, read as all of it now: a full
            # shuffle of the changed data (a block of some of them must stay that block)
            if self.block_shards == len(self._live_shards) and whole_block(state, self.block_shards):
                keys.remove("block_shards")
        for key in keys:
            if state.get(key) != getattr(self, key):
                raise UserInputError(
                    f"{where}: {key} was {brief(state.get(key))}, now {getattr(self, key)!r}; resume with the "
                    "same prepared dataset, context_length, stride, data seed and shuffle_block_shards"
                )
        consumed = state.get("samples_consumed")
        if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
            raise UserInputError(f"{where}: samples_consumed must be an integer >= 0, got {brief(consumed)}")
        return consumed

    def start_step_from_state(self, state: Mapping[str, Any]) -> int:
        """The optimizer step to resume at; refuses a state that belongs to another data stream."""
        consumed = self.check_same_stream(state)
        if consumed % self.global_batch_size:
            raise UserInputError(
                f"checkpoint data-sampler state: {consumed} samples consumed is not a multiple of global_batch_size "
                f"{self.global_batch_size} (it was {brief(state.get('global_batch_size'))}); resume with a global "
                "batch size that divides it"
            )
        return consumed // self.global_batch_size

    def load_state_dict(self, state: Mapping[str, Any]) -> int:
        self.start_step = self.start_step_from_state(state)
        return self.start_step


def whole_block(state: Mapping[str, Any], block_now: int) -> bool:
    """Whether a saved sampler state's shuffle block was all of its data's shards (`block_shards` ≥ its
    `num_shards`), or is more than `block_now` (this run's): what train.allow_data_change reads as all shards."""
    block, shards = state.get("block_shards"), state.get("num_shards")
    if not isinstance(block, int):
        return False
    return (isinstance(shards, int) and block >= shards) or block > block_now


# What changed data changes in a sampler state (train.allow_data_change), as against how its windows are cut
_DATA_KEYS = ("num_shards", "num_windows", "shard_tokens_sha256")


def _no_windows_message(num_tokens: int, num_shards: int, context_length: int) -> str:
    if num_shards == 1:
        return (
            f"the train split has {num_tokens} tokens, fewer than context_length + 1 = {context_length + 1}; "
            "use more data or a shorter context"
        )
    return (
        f"the train split has {num_tokens} tokens in {num_shards} shards, each fewer than context_length + 1 = "
        f"{context_length + 1} (a window never crosses a shard boundary); use more data, larger shards or a "
        "shorter context"
    )


def val_window_starts(
    num_tokens: int,
    context_length: int,
    *,
    micro_batch_size: int,
    max_batches: int,
    world_size: int = 1,
    rank: int = 0,
) -> np.ndarray:
    """Token offsets of a fixed validation set: non-overlapping windows (stride T) spread evenly over the split.

    Shape [batches, micro]: at most `max_batches` full batches (one short batch if fewer than `micro` windows
    exist). With several ranks and at least one batch per rank, each rank takes every world-th batch of a
    world-divisible prefix, so every rank runs the same number of batches and their mean is the global mean.
    """
    available = (num_tokens - 1) // context_length if num_tokens > context_length else 0
    count = min(max_batches * micro_batch_size, available)
    if count >= micro_batch_size:
        count -= count % micro_batch_size
    if count == 0:
        return np.empty((0, micro_batch_size), dtype=np.int64)
    # i * available // count is strictly increasing because count <= available: distinct, evenly spaced windows.
    starts = (np.arange(count, dtype=np.int64) * available // count) * context_length
    batches = starts.reshape(-1, min(count, micro_batch_size))
    if world_size > 1 and len(batches) >= world_size:
        batches = batches[: len(batches) - len(batches) % world_size][rank::world_size]
    return batches
