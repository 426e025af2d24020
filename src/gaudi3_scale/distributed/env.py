"""What a launcher (torchrun, `gaudi3 train`'s own) tells each rank through its environment, read in one place.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE in every worker; a single process has none of them
and is rank 0 of 1. Nothing here imports torch, so the monitors, trackers and run services may ask before torch
or Lightning is set up, or after they are gone.
"""

from __future__ import annotations

import os

__all__ = ["inside_launched_worker", "launched_local_rank", "launched_local_world_size", "launched_rank"]


def inside_launched_worker() -> bool:
    """A worker of a launcher that says who it is (torchrun and every launcher that speaks its variables)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_rank() -> int:
    """This process's global rank (0 for a single process)."""
    return int(os.environ.get("RANK", "0"))


def launched_local_rank() -> int:
    """This process's rank on its node (0 for a single process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def launched_local_world_size() -> int:
    """Ranks the launcher started on this node (1 for a single process)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
