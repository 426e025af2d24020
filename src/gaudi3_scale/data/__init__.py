"""Data: prepare (tokenize → shards + manifest), tokenizers, and the resumable rank-aware sampler / DataModule.

The torch / Lightning pieces (`TokenWindowDataset`, `ValWindowDataset`, `TokenDataModule`) are imported on first
access: `gaudi3 prepare` and its spawned tokenizer workers import this package and should not pay the ~3 s
Lightning import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gaudi3_scale.data.config import DataConfig
from gaudi3_scale.data.dataset import PreparedData, load_prepared
from gaudi3_scale.data.manifest import FORMAT_VERSION, Manifest, load_manifest, verify_prepared
from gaudi3_scale.data.mixture import MixtureSampler, SingleSource
from gaudi3_scale.data.prepare import prepare_dataset
from gaudi3_scale.data.sampler import WindowSampler, accumulation_steps, val_window_starts
from gaudi3_scale.data.tokenizers import (
    Tokenizer,
    build_tokenizer,
    get_tokenizer,
    load_tokenizer,
    register_tokenizer,
)
from gaudi3_scale.lazy import lazy_exports

if TYPE_CHECKING:
    from gaudi3_scale.data.datamodule import TokenDataModule
    from gaudi3_scale.data.loader import TokenWindowDataset, ValWindowDataset

__all__ = [
    "FORMAT_VERSION",
    "DataConfig",
    "Manifest",
    "MixtureSampler",
    "PreparedData",
    "SingleSource",
    "TokenDataModule",
    "TokenWindowDataset",
    "Tokenizer",
    "ValWindowDataset",
    "WindowSampler",
    "accumulation_steps",
    "build_tokenizer",
    "get_tokenizer",
    "load_manifest",
    "load_prepared",
    "load_tokenizer",
    "prepare_dataset",
    "register_tokenizer",
    "val_window_starts",
    "verify_prepared",
]

_LAZY = {
    "TokenDataModule": "gaudi3_scale.data.datamodule",
    "TokenWindowDataset": "gaudi3_scale.data.loader",
    "ValWindowDataset": "gaudi3_scale.data.loader",
}

__getattr__ = lazy_exports(__name__, _LAZY)
