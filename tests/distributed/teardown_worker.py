"""Worker for test_teardown: a rank that leaves the process group while the caller still holds a group reports
its gloo threads; dropped, they are gone. Writes OUT_DIR/threads-RANK as "held released".

    torchrun --nproc-per-node 2 teardown_worker.py OUT_DIR
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from gaudi3_scale.distributed.mesh import build_device_mesh
from gaudi3_scale.distributed.teardown import gloo_threads, leave_process_group


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = build_device_mesh("cpu", world_size=dist.get_world_size(), tp_size=1, dp_replicate=1)
    held = dist.new_group(ranks=[0, 1])  # a group of the caller's own
    flags = torch.ones(2)
    dist.all_reduce(flags, group=held)
    assert flags.tolist() == [2.0, 2.0]
    left_held = leave_process_group()  # the mesh is still held: built by build_device_mesh, its groups go
    del held
    gc.collect()
    Path(out_dir, f"threads-{rank}").write_text(f"{left_held} {gloo_threads()}")
    assert mesh.size() == 2  # held to here


if __name__ == "__main__":
    main(sys.argv[1])
