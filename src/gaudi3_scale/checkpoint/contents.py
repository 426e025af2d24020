"""What is in a checkpoint: the named entries of the dict a run saves and of its manifest, who owns each, and
typed readers. Every reader of these entries goes through this module; every writer through `Checkpointer.save`.

    entry               owner (a `Stateful` unless Lightning writes it)                 in a light checkpoint
    state_dict          the model: Lightning (the strategy gathers or shards it)         yes
    optimizer_states    the optimizer (AdamW moments): Lightning, the strategy            no
    lr_schedulers, loops, callbacks   Lightning: scheduler, step/epoch counters            no (counters: yes)
    TokenDataModule     the sampler's position: the data module                         no
    gaudi3_config       the resolved run config: GaudiTrainer                           yes
    gaudi3_rng          every rank's generators: `train.rng.RngStates`                  no
    gaudi3_health       the step guard (`health.guard.StepGuard`): batches skipped and dropped, the spike
                        detectors' histories, event counts                              no
    gaudi3_meta         manifest fields: StepCheckpoint (tokens seen, world size, layout, data and tokenizer
                        SHA-256, newest validation) and LiveCost (accrued cost); copied into the manifest at
                        commit, so `DATA_SHA256_KEY`, `TOKENIZER_SHA256_KEY` and `COST_KEY` are read without
                        loading the checkpoint                                          yes (+ tier)

Our entries are declared by their owners in a run's `CheckpointContents` (`register`); one hook writes them into
every checkpoint Lightning dumps (and the light writer's) and hands them back on a resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "CONFIG_KEY",
    "COST_KEY",
    "DATAMODULE_KEY",
    "DATA_SHA256_KEY",
    "DIFF_KEYS",
    "EPOCH_KEY",
    "GLOBAL_STEP_KEY",
    "HEALTH_KEY",
    "LIGHT_TIER",
    "META_KEY",
    "MODEL_PREFIX",
    "OPTIMIZER_STATES_KEY",
    "RNG_KEY",
    "SEMANTICS_KEY",
    "STATE_DICT_KEY",
    "TIER_KEY",
    "TOKENIZER_SHA256_KEY",
    "ZERO_PARTITIONS_KEY",
    "CheckpointContents",
    "FixedState",
    "Stateful",
    "global_step",
    "is_light",
    "model_weights",
    "run_config",
    "trained_data_sha256",
    "trained_tokenizer_sha256",
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
HEALTH_KEY = "gaudi3_health"  # the step guard: skipped and dropped batches, spike histories, event counts
RNG_KEY = "gaudi3_rng"  # every rank's Python, numpy and torch generator states (train.module)
META_KEY = "gaudi3_meta"  # entries copied into the manifest at commit (tokens_seen, strategy, cost, …)
MODEL_PREFIX = "model."  # LanguageModel keeps the Transformer as `self.model`
ZERO_PARTITIONS_KEY = (
    "zero_partitions"  # in optimizer_states[0]: one ZeRO optimizer state per rank (DeepSpeed)
)

# Entries of META_KEY, hence of the manifest.
DATA_SHA256_KEY = "data_sha256"  # the tokens trained on (data.manifest.tokens_sha256)
# The tokenizer they were made with (data.tokenizers.tokenizer_sha256); generate, serve and export refuse another.
TOKENIZER_SHA256_KEY = "tokenizer_sha256"
COST_KEY = "cost_usd"  # the run's accrued cost in USD
# The changes to what the models compute that the run computed with (models.semantics): a resume by a newer version
# names the ones its checkpoint lacks.
SEMANTICS_KEY = "model_semantics"
# A light checkpoint (checkpoint.light_every_steps) holds the weights, counters, run config and these entries, but
# no optimizer, scheduler, RNG or sampler state: it can be exported or served, never resumed. Full ones omit the key.
TIER_KEY = "tier"
LIGHT_TIER = "light"

# The top-level entries `gaudi3 ckpt diff` and `gaudi3 repro` compare bitwise: everything a resume restores, the
# step guard's state included (its skipped batches, spike histories and lr factor change training after a resume).
DIFF_KEYS = (GLOBAL_STEP_KEY, STATE_DICT_KEY, OPTIMIZER_STATES_KEY, DATAMODULE_KEY, RNG_KEY, HEALTH_KEY)


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


def trained_tokenizer_sha256(manifest: Mapping[str, Any] | None) -> str | None:
    """The identity of the tokenizer a checkpoint was trained with (`data.tokenizers.tokenizer_sha256`), from its
    manifest (None: predates the record, or a model of the user's trained on no dataset of ours)."""
    saved = (manifest or {}).get(TOKENIZER_SHA256_KEY)
    return saved if isinstance(saved, str) else None


class Stateful(Protocol):
    """What owns a checkpoint entry (the shape of `torch.distributed.checkpoint.stateful.Stateful`)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> None: ...


class FixedState:
    """An entry written into every checkpoint and not restored from one (the run config: a resume has its own)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, state_dict: Any) -> None:
        pass


@dataclass(frozen=True)
class _Entry:
    owner: Stateful
    light: bool  # also in light checkpoints
    meta: bool  # the owner's dict is merged into META_KEY (and so into the manifest)


class CheckpointContents:
    """Our entries of one run's checkpoints, declared by their owners (module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self.written: dict[
            str, Any
        ] = {}  # the entries of the last `save_into` (a sharded manifest reads META_KEY)

    def register(self, key: str, owner: Stateful, *, light: bool = False, meta: bool = False) -> None:
        """`owner.state_dict()` under `key` of every checkpoint (`light`: light ones too); with `meta` it is a dict
        merged into `META_KEY`, and `key` only names the owner. Each key once."""
        assert key not in self._entries, f"checkpoint entry {key!r} registered twice"
        self._entries[key] = _Entry(owner, light, meta)

    def save_into(self, checkpoint: dict[str, Any], *, light: bool = False) -> None:
        for key, entry in self._entries.items():
            if light and not entry.light:
                continue
            if entry.meta:
                checkpoint[META_KEY] = {**checkpoint.get(META_KEY, {}), **entry.owner.state_dict()}
            else:
                checkpoint[key] = entry.owner.state_dict()
        if light:
            checkpoint.setdefault(META_KEY, {})[TIER_KEY] = LIGHT_TIER
        self.written = {key: checkpoint[key] for key in (*self._entries, META_KEY) if key in checkpoint}

    def load_from(self, checkpoint: Mapping[str, Any]) -> None:
        """Hand each owner its entry back (a resume); an entry the checkpoint lacks is left to its owner's default."""
        for key, entry in self._entries.items():
            if entry.meta:
                entry.owner.load_state_dict(checkpoint.get(META_KEY, {}))
            elif key in checkpoint:
                entry.owner.load_state_dict(checkpoint[key])
