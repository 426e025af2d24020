"""The stop flags the ranks all-reduce (MAX) at each step boundary (`train.callbacks.GracefulInterrupt`): the
agreed signal and the rank to name with it come from one number, so they belong together — the highest signal, and
of the ranks that received that one, the lowest."""

from __future__ import annotations

import io
import signal
from pathlib import Path

from rich.console import Console


def _rank_flags(tmp_path: Path, world: int, received: dict[int, signal.Signals]) -> list[list[int]]:
    from gaudi3_scale.checkpoint import CheckpointConfig, Checkpointer
    from gaudi3_scale.train.callbacks import GracefulInterrupt, StepCheckpoint

    flags = []
    for rank in range(world):
        interrupt = GracefulInterrupt(
            StepCheckpoint(Checkpointer(CheckpointConfig(), tmp_path), every_steps=2),
            Console(file=io.StringIO()),
        )
        if rank in received:
            interrupt.request("test", received[rank])
        flags.append(interrupt._flags(rank, world))
    return flags


def _agreed(tmp_path: Path, world: int, received: dict[int, signal.Signals]) -> tuple[int, int, int]:
    from gaudi3_scale.train.callbacks import GracefulInterrupt

    reduced = [max(column) for column in zip(*_rank_flags(tmp_path, world, received), strict=True)]
    return GracefulInterrupt._read_flags(reduced, world)


def test_the_agreed_signal_is_named_with_a_rank_that_received_it(tmp_path: Path) -> None:
    sigterm, sigusr1 = int(signal.SIGTERM), int(signal.SIGUSR1)
    # rank 1 got SIGUSR1, rank 2 SIGTERM: SIGTERM (15 > 10) is agreed, and it reached rank 2, not rank 1
    assert _agreed(tmp_path, 4, {1: signal.SIGUSR1, 2: signal.SIGTERM}) == (sigterm, 0, 2)
    assert _agreed(tmp_path, 4, {3: signal.SIGTERM, 1: signal.SIGTERM}) == (
        sigterm,
        0,
        1,
    )  # the lowest of them
    assert _agreed(tmp_path, 8, {7: signal.SIGUSR1}) == (sigusr1, 0, 7)
    assert _agreed(tmp_path, 2, {})[0] == 0  # no stop
