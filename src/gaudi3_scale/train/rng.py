"""Every rank's Python, numpy and torch generator states as one `Stateful` entry of a checkpoint (`RNG_KEY`).

Nothing in our training draws from these global generators (weights, data order and dropout have their own seeded
streams), but user code may, so checkpoints record them and a resume restores them: two runs with the same seed
hold the same state. Each rank has its own stream; a checkpoint holds all of them in rank order.
"""

from __future__ import annotations

import io
import random
from typing import Any

import numpy as np
import torch

__all__ = ["RngStates", "capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    # Plain containers and tensors only, so checkpoints load with torch.load(weights_only=True).
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(np.array(keys)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RngStates:
    """The `Stateful` of `RNG_KEY`: `state_dict` gathers every rank's states (a collective: every rank calls it
    at the same save), `load_state_dict` restores this rank's. On a new world size a rank the checkpoint has no
    state for keeps its fresh seed + rank stream."""

    def state_dict(self) -> dict[str, Any]:
        states: list[Any] = [capture_rng_state()]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Gathered as torch.save bytes: all_gather_object cannot unpickle tensors on every torch version.
            buffer = io.BytesIO()
            torch.save(states[0], buffer)
            gathered: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, buffer.getvalue())
            states = [torch.load(io.BytesIO(b), weights_only=True) for b in gathered]
        return {"per_rank": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = state.get("per_rank", [])
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank < len(states):
            restore_rng_state(states[rank])
