"""Two checkpoints hold bitwise the same training state: model weights and optimizer state, tensor by tensor
(shared by tests/distributed/test_elastic_restart.py and test_hang_watchdog.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from gaudi3_scale.checkpoint.reader import read_checkpoint

__all__ = ["assert_same_training_state"]


def assert_same_training_state(want_path: Path, got_path: Path) -> None:
    want, got = read_checkpoint(want_path), read_checkpoint(got_path)
    for key in ("state_dict", "optimizer_states"):
        assert _flat(got[key]).keys() == _flat(want[key]).keys()
        for name, tensor in _flat(want[key]).items():
            assert torch.equal(_flat(got[key])[name], tensor), f"{key}.{name} differs"


def _flat(value: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}.{key}").items()}
    if isinstance(value, list | tuple):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}.{i}").items()}
    return {}
