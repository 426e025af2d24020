"""Checkpoints: directories committed by a manifest, verified on load, the `latest` pointer and retention.

`Checkpointer` (a run's manager, Lightning IO plugin and remote mirror) and `read_checkpoint` (the one reader) load
on first access, so importing the package (the key names in `checkpoint.contents`, the config) does not import
torch.
"""

from typing import TYPE_CHECKING

from gaudi3_scale.checkpoint.config import CheckpointConfig
from gaudi3_scale.lazy import lazy_exports

if TYPE_CHECKING:
    from gaudi3_scale.checkpoint.checkpointer import Checkpointer
    from gaudi3_scale.checkpoint.reader import read_checkpoint

__all__ = ["CheckpointConfig", "Checkpointer", "read_checkpoint"]

_LAZY = {
    "Checkpointer": "gaudi3_scale.checkpoint.checkpointer",
    "read_checkpoint": "gaudi3_scale.checkpoint.reader",
}

__getattr__ = lazy_exports(__name__, _LAZY)
