"""Leaving the process group at the end of a multi-rank run, with its gloo threads joined before the process exits.

`destroy_process_group` shuts the groups down but does not join gloo's worker threads (`pt_gloo_runloop`, two per
group): they end only when the last reference to their group goes. Meshes, FSDP's parameter groups, DeepSpeed's
partitioned parameters and DTensor's caches all hold groups. A worker thread still up while the interpreter
finalises can be the one that releases a finished collective's tensors; that needs the GIL, which a finalising
interpreter no longer hands out, and the rank aborts after a successful run ("terminate called without an active
exception"), now and then, more often on a loaded machine. So a run drops what holds its groups, then leaves here.
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from gaudi3_scale.distributed.mesh import release_mesh_groups

__all__ = ["KeptStore", "gloo_threads", "keep_store", "leave_process_group", "rejoin_process_group"]


def leave_process_group() -> int | None:
    """All ranks leave together, the groups are destroyed and released; returns the gloo threads still up: 0
    unless something outside the run still holds a group (a caller's own sharded model), None off Linux."""
    torch.distributed.barrier()  # no rank tears down while another still talks
    deepspeed_comm = sys.modules.get("deepspeed.comm")
    if deepspeed_comm is not None and deepspeed_comm.is_initialized():
        deepspeed_comm.destroy_process_group()  # torch's, and it lets go of DeepSpeed's own group globals
    else:
        torch.distributed.destroy_process_group()
    release_mesh_groups()
    gc.collect()  # the holders are in reference cycles (modules ↔ hooks); collected, the groups go
    return gloo_threads()


@dataclass(frozen=True)
class KeptStore:
    """The store and backend of a group about to be left, for a later group of the same ranks in this process."""

    store: Any
    backend: str
    rank: int
    world_size: int


def keep_store() -> KeptStore:
    """Call before `leave_process_group` when the same ranks will form a group again (a rollback's re-fit).

    A new default group under the same store reuses the old one's keys (its name is a hash of the ranks), and a
    rank can read a peer's stale address from them: "Gloo connectFullMesh failed … Connection refused". Holding the
    store also keeps rank 0's store server up when rank 0 hosts it (a launcher without an agent store)."""
    c10d = torch.distributed.distributed_c10d
    return KeptStore(
        store=c10d._get_default_store(),
        backend=str(torch.distributed.get_backend()),
        rank=torch.distributed.get_rank(),
        world_size=torch.distributed.get_world_size(),
    )


def rejoin_process_group(kept: KeptStore, *, attempt: int, timeout_s: float) -> None:
    """The default group again, its keys under a prefix of their own (`attempt`, the same on every rank); a strategy
    that finds the group initialized uses it."""
    torch.distributed.init_process_group(
        kept.backend,
        store=torch.distributed.PrefixStore(f"gaudi3-refit-{attempt}", kept.store),
        rank=kept.rank,
        world_size=kept.world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def gloo_threads() -> int | None:
    """How many gloo worker threads this process has (from /proc: Linux; None elsewhere)."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    if not tasks.is_dir():
        return None
    names = []
    for task in tasks.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended while we looked
            continue
    return names.count("pt_gloo_runloop")
