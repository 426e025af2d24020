"""Sharded checkpoints (`torch.distributed.checkpoint`, one file per rank) and their consolidation.

FSDP strategies save through DCP straight into the checkpoint directory:

    step-00000500/__0_0.distcp, __1_0.distcp   each rank's shards of the model and optimizer state
    step-00000500/.metadata                    DCP's index: which global tensor slice lives in which file
    step-00000500/meta.pt                      rank 0: everything else Lightning saves (loops, sampler, RNG, …)
    step-00000500/manifest.json                written last by rank 0, after every rank has written its shard

DCP stores every tensor by its fully qualified name with its global shape, so a sharded checkpoint loads on any
world size (DCP reshards) and under any strategy: FSDP loads it through DCP; DDP and single-process runs load it
consolidated by `consolidate` (model state dict + optimizer state keyed by parameter index, the layout
`torch.optim.Optimizer.state_dict` has).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gaudi3_scale.checkpoint.manifest import DCP_INDEX_NAME, SHARDED_META_NAME, manifest_layout, read_manifest

__all__ = ["SHARDED_META_NAME", "consolidate", "is_sharded", "optimizer_state_by_name", "read_sharded_meta"]


def is_sharded(directory: Path) -> bool:
    """Whether `directory` holds a sharded checkpoint: as its manifest commits it (files it does not list decide
    nothing); a directory without one (not ours, or never committed) by DCP's index and `meta.pt` being there."""
    manifest = read_manifest(directory)
    if manifest is not None:
        return manifest_layout(manifest) == "sharded"
    return all((directory / name).is_file() for name in (SHARDED_META_NAME, DCP_INDEX_NAME))


def read_sharded_meta(directory: Path) -> dict[str, Any]:
    """Rank 0's non-tensor state (loops, data sampler, RNG, config): cheap, no shard is read."""
    meta = torch.load(directory / SHARDED_META_NAME, map_location="cpu", weights_only=True)
    assert isinstance(meta, dict), f"{directory / SHARDED_META_NAME} is not a mapping"
    return meta


def _optimizer_state_by_index(state: dict[str, Any]) -> dict[str, Any]:
    """DCP's optimizer state (keyed by parameter name) → `Optimizer.state_dict()` layout (keyed by index).

    Indices run over the parameter groups in order, as `Optimizer.state_dict` numbers them, so the result loads
    into an optimizer built over the same parameter groups.
    """
    ids: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        params = [ids.setdefault(name, len(ids)) for name in group["params"]]
        groups.append({**group, "params": params})
    return {"state": {ids[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_name(state: dict[str, Any], optimizer: Any, module: torch.nn.Module) -> dict[str, Any]:
    """`Optimizer.state_dict()` layout (keyed by index over the groups) → keyed by parameter name, for DCP."""
    names = {id(p): name for name, p in module.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if "state" in state and all(isinstance(k, str) for k in state["state"]):
        return state  # already by name
    groups = [{**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]]
    return {"state": {order[i]: value for i, value in state["state"].items()}, "param_groups": groups}


def consolidate(directory: Path) -> dict[str, Any]:
    """A sharded checkpoint as one Lightning checkpoint dict with full tensors, read in this process alone."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    tensors: dict[str, Any] = {}
    _load_state_dict(
        tensors,
        storage_reader=FileSystemReader(directory),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    checkpoint = read_sharded_meta(directory)
    checkpoint["state_dict"] = tensors.pop("state_dict")
    optimizers = sorted((int(key.split("_", 1)[1]), value) for key, value in tensors.items()
                        if key.startswith("optimizer_"))  # fmt: skip
    checkpoint["optimizer_states"] = [_optimizer_state_by_index(state) for _, state in optimizers]
    return checkpoint
