"""Distributed training: strategies, parallelism applied to single-device models from outside, launching."""

from gaudi3_scale.distributed.config import STRATEGIES, ParallelConfig

__all__ = ["STRATEGIES", "ParallelConfig"]
