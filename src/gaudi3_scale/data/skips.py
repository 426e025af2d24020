"""Batches of the training stream that make no optimizer update, and where the stream stands because of them.

The stream is numbered by data step (global batch 0, 1, …; `WindowSampler` draws each from its index). Two kinds of
batch make no update:

    skipped  never loaded: `health.skip_batches`, and the batches a rollback skips
    dropped  loaded and trained on, but the step's update was dropped (a non-finite or spiking step)

so after `global_step` updates the next batch to load is the one after `global_step + len(dropped)` loaded ones,
counting past the skipped ones. That is what a checkpoint's sampler state records (`samples_consumed`), so a
resumed run loads exactly the batches an uninterrupted one would.

A resumed run counts from the checkpoint's position (`resume_at`): the stream it already passed is what that run
loaded and skipped, whatever the resumed run's list says about it, so a batch listed below that position (trained
already: a skip cannot take it back) moves nothing, and only the listed batches from there on are passed over.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["BatchSkips"]


class BatchSkips:
    def __init__(self, skipped: Iterable[int] = ()) -> None:
        self.skipped: list[int] = sorted(set(skipped))
        self.dropped: list[int] = []
        # (loads, data step) of a resumed run: the checkpoint's position, which the skips below it do not move
        self._resumed: tuple[int, int] | None = None

    def resume_at(self, *, loads: int, data_step: int) -> None:
        """The resumed stream's anchor: after `loads` loaded batches (updates + dropped) it stands at `data_step`
        (the checkpoint's)."""
        self._resumed = (loads, data_step)

    def next_data_step(self, global_step: int) -> int:
        """The data step the next batch comes from, after `global_step` updates."""
        return self.data_step_of_load(global_step + len(self.dropped))

    def data_step_of_load(self, loads: int) -> int:
        """The data step of the batch loaded after `loads` others (0-based), skipping the skipped ones."""
        step, first = loads, 0
        if self._resumed is not None and loads >= self._resumed[0]:
            step = self._resumed[1] + loads - self._resumed[0]
            first = bisect.bisect_left(self.skipped, self._resumed[1])  # only the skips from there on count
        # sorted: each one at or below the running answer pushes it up by one
        for skipped in self.skipped[first:]:
            if skipped <= step:
                step += 1
            else:
                break
        return step

    def drop(self, global_step: int) -> int:
        """The batch of the step after `global_step` updates made none: recorded; returns its data step."""
        step = self.next_data_step(global_step)
        self.dropped.append(step)
        return step

    def skip(self, steps: Iterable[int]) -> None:
        for step in steps:
            index = bisect.bisect_left(self.skipped, step)
            if index == len(self.skipped) or self.skipped[index] != step:
                self.skipped.insert(index, step)

    def is_skipped(self, data_step: int) -> bool:
        index = bisect.bisect_left(self.skipped, data_step)
        return index < len(self.skipped) and self.skipped[index] == data_step

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": list(self.skipped), "dropped": list(self.dropped)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's record joins what the config already skips."""
        self.skip(int(s) for s in state.get("skipped", []))
        self.dropped = [int(s) for s in state.get("dropped", [])]
