"""Weighted mixtures of datasets: which dataset, and which of its windows, every global sample comes from.

Assignment. Each member dataset has its own infinite window stream (a `WindowSampler`; its batch size, world size
and rank are ignored here, only its stream positions are used). Global sample ``k`` goes to the dataset ``d`` that
maximises the deficit ``w_d * (k + 1) - c_d(k)`` (weights normalised to sum 1, ties to the lowest index,
``c_d(k)`` = samples of ``d`` among ``[0, k)``), and is position ``c_d(k)`` of that dataset's stream. This is the
largest-deficit rule of Megatron-LM's blended datasets (``build_blending_indices`` in
megatron/core/datasets/helpers.cpp, which weighs by ``max(k, 1)`` where we use ``k + 1``): deterministic, world-size
independent, and never more than one sample away from the weights (``|c_d(k) - w_d k| < 1``). A zero weight gets
no samples. Deficits are computed from ``(k, counts)`` alone, never accumulated, so a resumed run makes the very
same float comparisons as one that never stopped.

Cost. ``c(k)`` depends on the whole history, so the sampler keeps the counts at a few stream positions it has
reached (the last batch's end, a checkpoint's counts) and walks forward from the nearest one: O(G × members) per
step for a loader that asks for steps in increasing order. `state_dict` stores the counts, so a resumed run does
not walk from 0.

`SingleSource` puts one `WindowSampler` behind the same call shape (member 0 for every sample) with that sampler's
own state format, so the loader has one code path and single-dataset checkpoints keep resuming.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from gaudi3_scale.config.core import check_positive
from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.data.config import weight_sum_problem
from gaudi3_scale.data.sampler import WindowSampler, accumulation_steps, rank_sample_positions

__all__ = ["MIXTURE_STATE_FORMAT", "MixtureSampler", "SingleSource", "TrainSampler"]

MIXTURE_STATE_FORMAT = "gaudi3-scale/mixture-sampler/1"
_KNOWN_POINTS_KEPT = (
    8  # stream positions whose counts are remembered (loader chunks, prefetch look-ups, states)
)
_WHERE = "checkpoint data-mixture state"


class TrainSampler(Protocol):
    """What the training loader uses: per step, the member and the virtual start of each of this rank's windows."""

    @property
    def members(self) -> tuple[WindowSampler, ...]: ...
    @property
    def accum_steps(self) -> int: ...
    @property
    def micro_batch_size(self) -> int: ...
    @property
    def global_batch_size(self) -> int: ...
    @property
    def context_length(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def start_step(self) -> int: ...

    def steps_starts(self, first_step: int, num_steps: int) -> tuple[np.ndarray, np.ndarray]: ...
    def upcoming_shards(self, first_sample: int, count: int) -> list[tuple[int, int]]: ...
    def state_dict(self, samples_consumed: int) -> dict[str, Any]: ...
    def start_step_from_state(self, state: Mapping[str, Any]) -> int: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> int: ...


class MixtureSampler:
    """This rank's windows of a weighted mixture of datasets, per optimizer step and micro-step."""

    def __init__(
        self,
        members: Sequence[WindowSampler],
        weights: Sequence[float],
        names: Sequence[str],
        *,
        global_batch_size: int,
        micro_batch_size: int,
        world_size: int = 1,
        rank: int = 0,
    ) -> None:
        self.members, self.weights, self.names = tuple(members), tuple(weights), tuple(names)
        self.fractions = _fractions(self.weights, self.names, len(self.members))
        for name, value in (
            ("global_batch_size", global_batch_size),
            ("micro_batch_size", micro_batch_size),
            ("world_size", world_size),
        ):
            check_positive(name, value)
        if not 0 <= rank < world_size:
            raise ConfigError("rank", f"must be in [0, world_size={world_size}), got {rank}")
        lengths = {m.context_length for m in self.members}
        if len(lengths) > 1:
            raise UserInputError(f"data mixture: members have context lengths {sorted(lengths)}; use one")
        self.context_length = lengths.pop()
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.world_size, self.rank = world_size, rank
        self.accum_steps = accumulation_steps(global_batch_size, micro_batch_size, world_size)
        self.start_step = 0
        self._active = tuple(d for d, w in enumerate(self.fractions) if w > 0)
        self._known: dict[int, tuple[int, ...]] = {0: (0,) * len(self.members)}  # sample → counts before it
        self._resumed_at = 0

    def _assign(
        self, first: int, count: int, counts: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
        """(member, position in its stream) of global samples ``first .. first + count - 1``, and the counts after."""
        active, done = self._active, list(counts)
        if len(active) == 1:
            (d,) = active
            done[d] += count
            return (
                np.full(count, d, dtype=np.int64),
                np.arange(counts[d], done[d], dtype=np.int64),
                tuple(done),
            )
        weights = [self.fractions[d] for d in active]
        taken = [counts[d] for d in active]
        picks, positions = [0] * count, [0] * count
        rest = range(1, len(active))
        for i in range(count):  # O(count × members): plain Python floats beat numpy on a handful of members
            k1 = float(first + i + 1)
            best, best_deficit = 0, weights[0] * k1 - taken[0]
            for j in rest:
                deficit = weights[j] * k1 - taken[j]
                if deficit > best_deficit:
                    best, best_deficit = j, deficit
            picks[i], positions[i] = best, taken[best]
            taken[best] += 1
        for j, d in enumerate(active):
            done[d] = taken[j]
        member_ids = np.asarray(active, dtype=np.int64)[np.asarray(picks, dtype=np.int64)]
        return member_ids, np.asarray(positions, dtype=np.int64), tuple(done)

    def counts_at(self, sample: int) -> tuple[int, ...]:
        """Samples of each member among global samples ``[0, sample)``, walked from the nearest known position."""
        start = max(k for k in self._known if k <= sample)
        counts = self._known[start]
        if start < sample:
            counts = self._assign(start, sample - start, counts)[2]
            self._remember(sample, counts)
        return counts

    def _remember(self, sample: int, counts: tuple[int, ...]) -> None:
        self._known[sample] = counts
        if len(self._known) > _KNOWN_POINTS_KEPT:
            del self._known[min(k for k in self._known if k not in (0, self._resumed_at))]

    def steps_starts(self, first_step: int, num_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """(member index, virtual start offset into that member's shards), each int64 [steps, accum, micro]."""
        first, count = first_step * self.global_batch_size, num_steps * self.global_batch_size
        member_ids, positions, after = self._assign(first, count, self.counts_at(first))
        self._remember(first + count, after)
        mine = rank_sample_positions(
            np.arange(num_steps, dtype=np.int64),
            np.arange(self.accum_steps, dtype=np.int64),
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            world_size=self.world_size,
            rank=self.rank,
        )
        ids, mine_positions = member_ids[mine], positions[mine]
        starts = np.empty_like(mine_positions)
        for d in np.unique(ids).tolist():
            sel = ids == d
            starts[sel] = self.members[d].sample_starts(mine_positions[sel])
        return ids, starts

    def upcoming_shards(self, first_sample: int, count: int) -> list[tuple[int, int]]:
        """The next `count` distinct (member, shard) pairs read from global sample `first_sample` on, soonest
        first: each member's upcoming shards, ordered by when the mixture is expected to reach them."""
        counts = self.counts_at(first_sample)
        soon: list[tuple[float, int, int]] = []
        for d in self._active:
            for shard, position in self.members[d].upcoming_shard_positions(counts[d], count):
                soon.append((first_sample + (position - counts[d]) / self.fractions[d], d, shard))
        soon.sort()
        return [(d, shard) for _, d, shard in soon[:count]]

    def state_dict(self, samples_consumed: int) -> dict[str, Any]:
        counts = self.counts_at(samples_consumed)
        return {
            "format": MIXTURE_STATE_FORMAT,
            "samples_consumed": samples_consumed,
            "global_batch_size": self.global_batch_size,  # informational, as in the WindowSampler state
            "members": [
                {"name": name, "weight": weight, "consumed": c, "sampler": member.state_dict(c)}
                for name, weight, c, member in zip(
                    self.names, self.weights, counts, self.members, strict=True
                )
            ],
        }

    def start_step_from_state(self, state: Mapping[str, Any]) -> int:
        """The optimizer step to resume at; refuses a state of another mixture. Its counts are remembered (they
        are a function of the position, so this only spares walking the stream from 0)."""
        found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        if found != MIXTURE_STATE_FORMAT:
            raise UserInputError(f"{_WHERE}: format {brief(found)} is not {MIXTURE_STATE_FORMAT!r}")
        entries = state.get("members")
        if not isinstance(entries, list) or not all(isinstance(e, Mapping) for e in entries):
            raise UserInputError(f"{_WHERE}: members must be a list of mappings, got {brief(entries)}")
        names = [e.get("name") for e in entries]
        if names != list(self.names):
            raise UserInputError(
                f"{_WHERE}: members were {brief(names)}, now {brief(list(self.names))}; resume with the same "
                "data.mixture"
            )
        weights = [e.get("weight") for e in entries]
        if _same_fractions(weights, self.fractions) is False:
            raise UserInputError(
                f"{_WHERE}: weights were {brief(weights)}, now {brief(list(self.weights))}; resume with the same "
                "data.mixture weights"
            )
        counts = tuple(
            member.check_same_stream(entry["sampler"], where=f"{_WHERE}, member {name!r}")
            if isinstance(entry.get("sampler"), Mapping)
            else _bad_member_state(name)
            for member, entry, name in zip(self.members, entries, self.names, strict=True)
        )
        return self._resume_at(state.get("samples_consumed"), counts, [e.get("consumed") for e in entries])

    def _resume_at(self, consumed: Any, counts: tuple[int, ...], listed: list[Any]) -> int:
        if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
            raise UserInputError(f"{_WHERE}: samples_consumed must be an integer >= 0, got {brief(consumed)}")
        if list(counts) != listed or sum(counts) != consumed:
            raise UserInputError(
                f"{_WHERE}: member counts {brief(listed)} (their samplers say {brief(list(counts))}) do not add "
                f"up to samples_consumed {consumed}; the state is damaged"
            )
        if consumed % self.global_batch_size:
            raise UserInputError(
                f"{_WHERE}: {consumed} samples consumed is not a multiple of global_batch_size "
                f"{self.global_batch_size}; resume with a global batch size that divides it"
            )
        self._resumed_at = consumed
        self._remember(consumed, counts)
        return consumed // self.global_batch_size

    def load_state_dict(self, state: Mapping[str, Any]) -> int:
        self.start_step = self.start_step_from_state(state)
        return self.start_step


class SingleSource:
    """One `WindowSampler` in `MixtureSampler`'s call shape: member 0 for every sample, the sampler's own state."""

    def __init__(self, sampler: WindowSampler) -> None:
        self.sampler = sampler
        self.members = (sampler,)

    @property
    def accum_steps(self) -> int:
        return self.sampler.accum_steps

    @property
    def micro_batch_size(self) -> int:
        return self.sampler.micro_batch_size

    @property
    def global_batch_size(self) -> int:
        return self.sampler.global_batch_size

    @property
    def context_length(self) -> int:
        return self.sampler.context_length

    @property
    def world_size(self) -> int:
        return self.sampler.world_size

    @property
    def rank(self) -> int:
        return self.sampler.rank

    @property
    def start_step(self) -> int:
        return self.sampler.start_step

    def steps_starts(self, first_step: int, num_steps: int) -> tuple[np.ndarray, np.ndarray]:
        starts = self.sampler.steps_starts(first_step, num_steps)
        return np.zeros_like(starts), starts

    def upcoming_shards(self, first_sample: int, count: int) -> list[tuple[int, int]]:
        return [(0, shard) for shard in self.sampler.upcoming_shards(first_sample, count)]

    def state_dict(self, samples_consumed: int) -> dict[str, Any]:
        return self.sampler.state_dict(samples_consumed)

    def start_step_from_state(self, state: Mapping[str, Any]) -> int:
        return self.sampler.start_step_from_state(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> int:
        return self.sampler.load_state_dict(state)


if TYPE_CHECKING:  # mypy checks that both offer everything the loader uses
    _TRAIN_SAMPLERS: tuple[type[TrainSampler], ...] = (MixtureSampler, SingleSource)


def _fractions(weights: tuple[Any, ...], names: tuple[Any, ...], num_members: int) -> tuple[float, ...]:
    """Weights normalised to sum 1; one line on anything else."""
    if num_members == 0:
        raise UserInputError("data mixture: no members; list at least one dataset")
    if len(weights) != num_members or len(names) != num_members:
        raise UserInputError(
            f"data mixture: {num_members} members, {len(weights)} weights and {len(names)} names; give each "
            "member one weight and one name"
        )
    if len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
        raise UserInputError(f"data mixture: member names {brief(list(names))} must be distinct strings")
    for name, weight in zip(names, weights, strict=True):
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
            or weight < 0
        ):
            raise UserInputError(
                f"data mixture: weight of {name!r} is {brief(weight)}; use a finite number >= 0"
            )
    if problem := weight_sum_problem(weights):
        raise UserInputError(f"data mixture: {problem}")
    total = math.fsum(weights)
    return tuple(w / total for w in weights)


def _same_fractions(weights: list[Any], fractions: tuple[float, ...]) -> bool:
    try:
        return (
            _fractions(tuple(weights), tuple(str(i) for i in range(len(weights))), len(fractions))
            == fractions
        )
    except UserInputError:
        return False


def _bad_member_state(name: str) -> int:
    raise UserInputError(f"{_WHERE}, member {name!r}: sampler state missing")
