"""The device mesh of a sharded run: (pipeline, dp_replicate, dp_shard, tensor_parallel), tensor parallel
innermost, pipeline outermost (torchtitan's order).

    rank = ((pp_rank × dp_replicate + replica) × dp_shard + shard) × tp_size + tp_rank

Tensor-parallel ranks are neighbours (they talk every layer, so they share a node: `parallel.tp_size` divides
nproc_per_node); FSDP shards over `dp_shard`, HSDP replicates over `dp_replicate`; pipeline stages, which only
pass activations to their neighbour stage, are the farthest apart. The ranks that read different data are the two
data-parallel dimensions together, and a rank's coordinate on them is `(rank // tp_size) mod data-parallel size`,
which the data module uses without a mesh (`data_parallel_rank`).
"""

from __future__ import annotations

import weakref
from typing import Any

from gaudi3_scale.distributed.plan import data_parallel_size

__all__ = [
    "DP_REPLICATE",
    "DP_SHARD",
    "PP_DIM",
    "TP_DIM",
    "build_device_mesh",
    "data_parallel_coordinate",
    "data_parallel_mesh",
    "data_parallel_rank",
    "release_mesh_groups",
]

PP_DIM, DP_REPLICATE, DP_SHARD, TP_DIM = "pipeline", "dp_replicate", "dp_shard", "tensor_parallel"

# The meshes build_device_mesh made, for release_mesh_groups; by id: meshes of one shape compare (and hash) equal.
_BUILT: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def build_device_mesh(
    device_type: str, *, world_size: int, tp_size: int, dp_replicate: int, pp_size: int = 1
) -> Any:
    """The run's 4-D mesh (sizes of 1 allowed); the process group must be initialised."""
    from torch.distributed.device_mesh import init_device_mesh

    data_parallel = data_parallel_size(world_size, tp_size, pp_size)
    assert data_parallel % dp_replicate == 0, "validated by the config"
    mesh = init_device_mesh(
        device_type,
        (pp_size, dp_replicate, data_parallel // dp_replicate, tp_size),
        mesh_dim_names=(PP_DIM, DP_REPLICATE, DP_SHARD, TP_DIM),
    )
    if tp_size > 1:
        # A norm over FSDP×TP shards (gradient clipping) is partial on both dimensions; with them flattened,
        # DTensor reduces it in one all-reduce instead of two in sequence.
        mesh[(DP_SHARD, TP_DIM)]._flatten()
    _BUILT[id(mesh)] = mesh
    return mesh


def release_mesh_groups() -> None:
    """After `destroy_process_group`: let go of the groups the meshes built here still hold.

    A mesh keeps its dimensions' process groups (and those of its flattened dimensions) in `_pg_registry`, and
    DTensor's sharding and redistribution caches keep meshes for the life of the process. gloo's worker threads
    end only when the last reference to their group goes, so without this they run until the interpreter exits.
    """
    for mesh in list(_BUILT.values()):
        # A private field of the root mesh (torch 2.13); its sub-meshes and flattened dimensions register there.
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def data_parallel_mesh(mesh: Any) -> Any:
    """What FSDP shards over: the 2-D (replicate, shard) mesh for HSDP, else the 1-D shard dimension."""
    return mesh[(DP_REPLICATE, DP_SHARD)] if mesh[DP_REPLICATE].size() > 1 else mesh[DP_SHARD]


def data_parallel_rank(global_rank: int, tp_size: int, data_parallel_size: int | None = None) -> int:
    """This rank's coordinate on the flattened data-parallel dimensions: the ranks of one tensor-parallel group, and
    the stages of one pipeline, share it and read the same batches. `data_parallel_size` is needed under pipeline
    parallel only (the pipeline dimension is outside the data-parallel ones)."""
    group = global_rank // tp_size
    return group if data_parallel_size is None else group % data_parallel_size


def data_parallel_coordinate(
    world_size: int, global_rank: int, tp_size: int, pp_size: int
) -> tuple[int, int]:
    """(data-parallel ranks, this rank's coordinate among them): what a sampler splits the data over."""
    replicas = data_parallel_size(world_size, tp_size, pp_size)
    return replicas, data_parallel_rank(global_rank, tp_size, replicas)
