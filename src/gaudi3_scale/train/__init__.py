"""Training: the run config, the LightningModule, GaudiTrainer and its callbacks."""

from gaudi3_scale.train.config import OptimConfig, RunConfig, TrainConfig, build_run_config
from gaudi3_scale.train.module import LanguageModel
from gaudi3_scale.train.trainer import GaudiTrainer

__all__ = ["GaudiTrainer", "LanguageModel", "OptimConfig", "RunConfig", "TrainConfig", "build_run_config"]
