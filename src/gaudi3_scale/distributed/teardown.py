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
from pathlib import Path

import torch

from gaudi3_scale.distributed.mesh import release_mesh_groups

__all__ = ["gloo_threads", "leave_process_group"]


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
