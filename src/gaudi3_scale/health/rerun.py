"""The re-run check (`health.rerun_check`, off by default): after a non-finite step or a spike, the same optimizer
step is run once more from the same state — the same micro-batches, the same dropout masks, the parameters not yet
updated — and the two results are compared bit for bit, as Megatron-LM's re-run state machine does to tell a fault
of the hardware (silent data corruption: the re-run differs) from a problem of the data or of the optimisation
(the re-run reproduces it).

What is compared: each rank's own loss of every micro-batch (a rank whose forward pass gave other bits is named)
and the gradient norm after the gradients are synchronised (a difference there without a differing loss is a
fault in some rank's backward pass; which rank cannot be told from synchronised gradients). A reproduced event
names its batch: the data step and, for every sample of the global batch, the rank, dataset member, shard and token
offset it was read from.

Under pipeline parallel the step is re-run whole through the schedule; its one loss is the pipeline's (the last
stage's mean, the same on every stage), so a differing re-run names the ranks of that pipeline.

It costs nothing until an event: the step keeps references to its micro-batches (no copy) and their losses. At an
event it costs one more forward and backward pass of the step, one all-reduce of a flag per rank and one gather of
the batch's locations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MAX_SAMPLES_NAMED", "RerunVerdict", "batch_locations", "compare_reruns", "same_bits"]

MAX_SAMPLES_NAMED = 64  # a record lists at most this many samples of the batch (and how many there were)


@dataclass(frozen=True)
class RerunVerdict:
    """What the re-run of optimizer step `step` showed."""

    reproduced: bool
    ranks: tuple[int, ...]  # ranks whose own losses differed on the re-run (empty: none, or not known)
    norm_differs: bool
    batch: dict[
        str, Any
    ]  # {"data_step", "samples": [{"rank", "member", "shard", "offset"}…], "samples_total"}

    @property
    def suspect(self) -> str:
        return "data" if self.reproduced else "hardware"

    def record(self) -> dict[str, Any]:
        """The `rerun` field of the event's metrics.jsonl record."""
        return {
            "reproduced": self.reproduced,
            "suspect": self.suspect,
            "verdict": self.describe(),
            "ranks": list(self.ranks),
            "norm_differs": self.norm_differs,
            "batch": self.batch,
        }

    def describe(self) -> str:
        if not self.reproduced:
            where = (
                f"rank(s) {', '.join(map(str, self.ranks))} computed other losses"
                if self.ranks
                else "the gradient norm differed (a backward pass; the rank cannot be told)"
            )
            return f"re-run differs: hardware fault suspected, {where}"
        first = self.batch.get("samples", [])[:1]
        where = (
            f" (first sample: rank {first[0]['rank']}, member {first[0]['member']}, shard {first[0]['shard']}, "
            f"offset {first[0]['offset']})"
            if first
            else ""
        )
        return f"re-run reproduces it: a data or optimisation problem, data batch {self.batch.get('data_step')}{where}"


def same_bits(a: float | None, b: float | None) -> bool:
    """Whether two results are the same value (NaN equals NaN: a reproduced NaN is reproduced)."""
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))


def compare_reruns(
    first_losses: list[float],
    rerun_losses: list[float],
    first_norm: float | None,
    rerun_norm: float | None,
    *,
    batch: dict[str, Any],
) -> RerunVerdict:
    """The verdict, agreed on every rank: one all-reduce of a flag per rank whose own losses differ."""
    differs = len(first_losses) != len(rerun_losses) or not all(
        same_bits(a, b) for a, b in zip(first_losses, rerun_losses, strict=False)
    )
    ranks: tuple[int, ...] = (0,) if differs else ()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        flags = torch.zeros(world)
        flags[rank] = float(differs)
        torch.distributed.all_reduce(flags)
        ranks = tuple(i for i, flag in enumerate(flags.tolist()) if flag > 0)
    norm_differs = not same_bits(first_norm, rerun_norm)
    return RerunVerdict(
        reproduced=not ranks and not norm_differs, ranks=ranks, norm_differs=norm_differs, batch=batch
    )


def batch_locations(sampler: Any, data_step: int) -> dict[str, Any]:
    """Where every sample of data step `data_step` was read from, over all ranks (one gather): the rank, dataset
    member, shard and token offset of each, from the run's `TrainSampler` (None: only the data step is named)."""
    mine: list[dict[str, int]] = []
    if sampler is not None and hasattr(sampler, "steps_starts"):
        found = sampler.steps_starts(
            data_step, 1
        )  # a WindowSampler's starts, or a mixture's (members, starts)
        members, starts = found if isinstance(found, tuple) else (None, found)
        sources = getattr(sampler, "members", (sampler,))
        flat_members = [0] * starts.size if members is None else members.ravel().tolist()
        for member_index, start in zip(flat_members, starts.ravel().tolist(), strict=True):
            shards, offsets = sources[member_index].locate([start])
            mine.append({"member": member_index, "shard": int(shards[0]), "offset": int(offsets[0])})
    everyone: list[Any] = [mine]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
    samples = [{"rank": rank, **where} for rank, located in enumerate(everyone) for where in located]
    return {
        "data_step": data_step,
        "samples": samples[:MAX_SAMPLES_NAMED],
        "samples_total": len(samples),
    }
