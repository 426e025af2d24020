"""Training: the run config, the LightningModule, GaudiTrainer and its callbacks.

The config names load at once; the Lightning pieces (`LanguageModel`, `GaudiTrainer`) on first access, so
resolving or printing a config (`gaudi3 train --print-config`, a config error) does not pay for importing
Lightning and torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gaudi3_scale.lazy import lazy_exports
from gaudi3_scale.train.config import RunConfig, build_run_config
from gaudi3_scale.train.optim_config import OptimConfig
from gaudi3_scale.train.train_config import TrainConfig

if TYPE_CHECKING:
    from gaudi3_scale.train.module import LanguageModel
    from gaudi3_scale.train.trainer import GaudiTrainer

__all__ = ["GaudiTrainer", "LanguageModel", "OptimConfig", "RunConfig", "TrainConfig", "build_run_config"]

_LAZY = {"LanguageModel": "gaudi3_scale.train.module", "GaudiTrainer": "gaudi3_scale.train.trainer"}

__getattr__ = lazy_exports(__name__, _LAZY)
