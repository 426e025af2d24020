"""Checkpoints: directories committed by a manifest, verified on load, the `latest` pointer and retention."""

from gaudi3_scale.checkpoint.config import CheckpointConfig

__all__ = ["CheckpointConfig"]
