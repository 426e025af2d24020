"""What is in a checkpoint: the named entries of the dict a run saves and of its manifest, and typed readers.

A checkpoint dict is what Lightning saves (`dump_checkpoint`: weights, optimizer states, loop and callback state,
the datamodule's state under its class name) plus our entries (`CONFIG_KEY`, `RNG_KEY`, `META_KEY`). The items of
`META_KEY` are copied into the manifest at commit, so `DATA_SHA256_KEY` and `COST_KEY` are read from the manifest,
without loading the checkpoint. Every reader of these entries goes through this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "CONFIG_KEY",
    "COST_KEY",
    "DATAMODULE_KEY",
    "DATA_SHA256_KEY",
    "DIFF_KEYS",
    "EPOCH_KEY",
    "GLOBAL_STEP_KEY",
    "LIGHT_TIER",
    "META_KEY",
    "MODEL_PREFIX",
    "OPTIMIZER_STATES_KEY",
    "RNG_KEY",
    "STATE_DICT_KEY",
    "TIER_KEY",
    "ZERO_PARTITIONS_KEY",
    "global_step",
    "is_light",
    "model_weights",
    "run_config",
    "trained_data_sha256",
    "zero_layout",
]

# Written by Lightning (`_CheckpointConnector.dump_checkpoint`).
STATE_DICT_KEY = "state_dict"  # the LightningModule's weights
OPTIMIZER_STATES_KEY = "optimizer_states"  # one `Optimizer.state_dict()` per optimizer
GLOBAL_STEP_KEY = "global_step"
EPOCH_KEY = "epoch"
DATAMODULE_KEY = "TokenDataModule"  # Lightning stores a datamodule's state_dict under its class name

# Written by gaudi3-scale.
CONFIG_KEY = "gaudi3_config"  # the resolved run config (train.module.LanguageModel / GaudiTrainer)
RNG_KEY = "gaudi3_rng"  # every rank's Python, numpy and torch generator states (train.module)
META_KEY = "gaudi3_meta"  # entries copied into the manifest at commit (tokens_seen, strategy, cost, …)
MODEL_PREFIX = "model."  # LanguageModel keeps the Transformer as `self.model`
ZERO_PARTITIONS_KEY = (
    "zero_partitions"  # in optimizer_states[0]: one ZeRO optimizer state per rank (DeepSpeed)
)

# Entries of META_KEY, hence of the manifest.
DATA_SHA256_KEY = "data_sha256"  # the tokens trained on (data.manifest.tokens_sha256)
COST_KEY = "cost_usd"  # the run's accrued cost in USD
# A light checkpoint (checkpoint.light_every_steps) holds the weights, counters, run config and these entries, but
# no optimizer, scheduler, RNG or sampler state: it can be exported or served, never resumed. Full ones omit the key.
TIER_KEY = "tier"
LIGHT_TIER = "light"

# The top-level entries `gaudi3 ckpt diff` and `gaudi3 repro` compare bitwise: everything a resume restores.
DIFF_KEYS = (GLOBAL_STEP_KEY, STATE_DICT_KEY, OPTIMIZER_STATES_KEY, DATAMODULE_KEY, RNG_KEY)


def run_config(checkpoint: Mapping[str, Any]) -> dict[str, Any] | None:
    """The resolved run config the checkpoint was trained with (None for checkpoints that predate storing it)."""
    saved = checkpoint.get(CONFIG_KEY)
    return saved if isinstance(saved, dict) else None


def global_step(checkpoint: Mapping[str, Any]) -> int | None:
    step = checkpoint.get(GLOBAL_STEP_KEY)
    return step if isinstance(step, int) else None


def model_weights(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The Transformer's weights, keyed as in `Transformer.state_dict()` (the LightningModule's prefix removed)."""
    state = checkpoint.get(STATE_DICT_KEY) or {}
    return {k[len(MODEL_PREFIX) :]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}


def is_light(manifest: Mapping[str, Any] | None) -> bool:
    """Whether a checkpoint's manifest marks it as light (weights only, not resumable)."""
    return (manifest or {}).get(TIER_KEY) == LIGHT_TIER


def zero_layout(checkpoint: Mapping[str, Any]) -> tuple[int, int] | None:
    """(ZeRO stage, world size) of DeepSpeed optimizer partitions; None when the optimizer state is not one."""
    states = checkpoint.get(OPTIMIZER_STATES_KEY) or []
    saved = states[0] if states else {}
    if ZERO_PARTITIONS_KEY not in saved:
        return None
    return int(saved["zero_stage"]), int(saved["world_size"])


def trained_data_sha256(manifest: Mapping[str, Any] | None) -> str | None:
    """The prepared tokens' SHA-256 a checkpoint was trained on, from its manifest (None: predates the record)."""
    saved = (manifest or {}).get(DATA_SHA256_KEY)
    return saved if isinstance(saved, str) else None
