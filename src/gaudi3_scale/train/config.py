"""The run config: one typed tree composed of the section configs that live beside their owners.

`RunConfig` is what `gaudi3 train --config run.yaml --model.num_layers 6` builds and what every run writes to
`<out>/config.yaml`. The model section starts from the registry preset named by `model.name`; fields the user sets
override the preset, so the resolved file always shows the full shape.
"""

from __future__ import annotations

import functools
import math
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from gaudi3_scale.checkpoint.config import CheckpointConfig
from gaudi3_scale.config.core import (
    Override,
    apply_overrides,
    check_field_types,
    check_name,
    from_dict,
    load_yaml,
    merge_mappings,
    parse_overrides,
    to_dict,
)
from gaudi3_scale.config.errors import ConfigError, brief
from gaudi3_scale.config.numbers import check_seed
from gaudi3_scale.config.urls import check_no_credentials
from gaudi3_scale.data.config import DataConfig
from gaudi3_scale.device.float8 import Float8Plan
from gaudi3_scale.device.hpu import HPU_COMPILE_BACKEND
from gaudi3_scale.distributed.config import ParallelConfig
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan, data_parallel_size
from gaudi3_scale.distributed.stages import check_pipeline
from gaudi3_scale.health.config import HealthConfig
from gaudi3_scale.metering.config import CostConfig
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.monitor.config import MonitorConfig
from gaudi3_scale.train.bench_config import BenchmarkConfig
from gaudi3_scale.train.optim_config import OptimConfig
from gaudi3_scale.train.train_config import TrainConfig

__all__ = [
    "RunConfig",
    "build_run_config",
    "check_tensor_parallel",
    "config_dict",
    "config_yaml",
    "per_rank_checkpoints",
    "resolve_config",
    "sharded_by",
    "throwaway_run_overrides",
]


@dataclass(kw_only=True)
class RunConfig:
    name: str = field(
        default="shakespeare-char",
        metadata={
            "help": "run name, outputs go to runs/<name>/ (letters, digits, . _ -); default: the model.name preset"
        },
    )
    out_dir: str | None = field(default=None, metadata={"help": "output directory; null = runs/<name>"})
    seed: int = field(default=1337, metadata={"help": "seed for weights, data order and dropout"})
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def __post_init__(self) -> None:
        _check_sections(self)
        check_field_types(self)  # name, out_dir and seed as YAML would take them
        check_name("name", self.name)
        check_seed("seed", self.seed)
        tokens = self.train.global_batch_tokens
        if tokens is not None:
            size = _batch_size_from_tokens(tokens, self.model.context_length)
            if size != self.train.global_batch_size:
                raise ConfigError(
                    "train.global_batch_tokens",
                    f"{tokens} tokens = {size} sequences of model.context_length {self.model.context_length}, "
                    f"but train.global_batch_size is {self.train.global_batch_size}; set only one of them",
                )
        # Fail before launching anything when the batch does not split over the ranks.
        batch = self.batch_plan()
        check_tensor_parallel(self.model, self.parallel.tp_size)
        check_pipeline(
            self.model,
            self.parallel,
            accumulation=batch.accumulation,
            compile_mode=self.train.compile_mode if self.train.compile else None,
            micro_batch_size=batch.micro_batch_size,
        )
        if self.health.spike_policy == "rollback" and not self.checkpoint.enabled:
            raise ConfigError(
                "health.spike_policy",
                "rollback restores a checkpoint, but checkpoint.enabled is false; allowed without checkpoints: "
                "off, warn, skip",
            )
        _check_expert_parallel(self.model, self.parallel.ep_size)
        if (
            self.checkpoint.enabled
            and self.checkpoint.light_every_steps
            and (sharded := sharded_by(self.parallel))
        ):
            # refused here, before any rank is launched (the trainer's own check names a user's strategy object)
            raise ConfigError(
                "checkpoint.light_every_steps",
                f"light checkpoints are one file written by rank 0, but {sharded} saves sharded checkpoints (not "
                "supported yet); set it to 0 and export a full checkpoint instead",
            )
        if self.train.precision == "16-mixed" and (sharded := sharded_by(self.parallel)):
            # Lightning's fp16 loss scaler is not FSDP2's sharded one, and a pipeline's backward never scales the
            # loss: its unscale_ fails on the first step (the tuner's estimator refuses the same: tune.memory).
            raise ConfigError(
                "train.precision",
                f"16-mixed (fp16 with a loss scale) runs with parallel.strategy auto, single, ddp or deepspeed, not "
                f"with {sharded}; use bf16-mixed (32-true on a GPU without bf16)",
            )
        if self.parallel.tp_size > 1 and self.train.precision == "fp8":
            raise ConfigError(
                "train.precision",
                "fp8 swaps linears that tensor parallel has already sharded (float8 tensor parallel is not "
                "implemented); with parallel.tp_size > 1 use auto, 32-true or bf16-mixed",
            )
        graphs = self.train.compile_mode == "reduce-overhead"
        if graphs and self.parallel.strategy not in ("auto", "single", "ddp"):
            raise ConfigError(
                "train.compile_mode",
                f"reduce-overhead (CUDA graphs) runs with parallel.strategy auto, single or ddp, not "
                f"{self.parallel.strategy}: sharded parameters are gathered outside any graph",
            )
        if self.train.compile and self.train.hpu_graphs:
            # Habana's PyTorch support matrix: torch.compile (hpu_backend) runs in eager mode only (PT_HPU_LAZY_MODE=0),
            # HPU graphs in lazy mode only (PT_HPU_LAZY_MODE=1). Not yet validated on Gaudi hardware.
            raise ConfigError(
                "train.compile",
                "torch.compile on Gaudi runs in eager mode, train.hpu_graphs in lazy mode; allowed: one of them",
            )
        if self.train.compile and self.parallel_plan().partitions_parameters:
            raise ConfigError(
                "train.compile",
                "TorchDynamo cannot trace DeepSpeed ZeRO-3's parameter hooks; with deepspeed_zero3 use "
                "train.compile false, or compile under ddp, fsdp, fsdp_grad_op or deepspeed_zero2",
            )

    @property
    def output_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path("runs") / self.name

    def batch_plan(self, world_size: int | None = None) -> BatchPlan:
        """How each optimizer step's global batch splits over `world_size` ranks (default: the configured
        launch geometry) and micro-steps; a batch that does not split is a `ConfigError`."""
        world = world_size or self.parallel.world_size
        micro = self.train.micro_batch_size
        if micro is None and self.parallel.pp_size > 1:
            # torchtitan's default under a pipeline (micro-batch 1): every sequence is a pipeline micro-batch, the
            # smallest bubble, and 1F1B always has the pp_size micro-batches it needs once each rank has that many
            micro = 1
        return BatchPlan.build(
            global_batch_size=self.train.global_batch_size,
            micro_batch_size=micro,
            data_parallel_size=data_parallel_size(world, self.parallel.tp_size, self.parallel.pp_size),
            context_length=self.model.context_length,
        )

    def float8_plan(self) -> Float8Plan:
        """How `train.precision fp8` converts the linears (`train.fp8_*`)."""
        return Float8Plan(
            recipe=self.train.fp8_recipe,
            head=self.train.fp8_head,
            skip_small_linears=self.train.fp8_skip_small_linears,
        )

    def parallel_plan(
        self,
        world_size: int | None = None,
        *,
        float8: bool = False,
        bf16_mixed: bool = False,
        accelerator: str | None = None,
    ) -> ParallelPlan:
        """What is applied to the model and which strategy runs it, resolved for `world_size` ranks; `float8`,
        `bf16_mixed` and the `accelerator` it runs on come from the device plan (`device.plan_device`; on Gaudi
        torch.compile takes Habana's backend), the float8 recipe and head from `train`."""
        plan = ParallelPlan.build(
            strategy=self.parallel.strategy,
            world_size=world_size or self.parallel.world_size,
            activation_checkpointing=self.parallel.activation_checkpointing,
            compile=self.train.compile,
            compile_mode=self.train.compile_mode,
            compile_backend=HPU_COMPILE_BACKEND if accelerator == "hpu" else "inductor",
            float8=self.float8_plan() if float8 else None,
            hpu_graphs=self.train.hpu_graphs,
            tp_size=self.parallel.tp_size,
            dp_replicate=self.parallel.dp_replicate,
            offload=self.parallel.offload,
            pp_size=self.parallel.pp_size,
            pp_schedule=self.parallel.pp_schedule,
            pp_split=tuple(self.parallel.pp_split),
        )
        return replace(plan, bf16_params=bf16_mixed and plan.shards_parameters)


def _check_sections(cfg: RunConfig) -> None:
    """Each section is its config class. A mapping is refused rather than built here: `model` needs its preset
    expanded first, which `build_run_config(base=...)` does for every section."""
    for name, tp in _section_types().items():
        value = getattr(cfg, name)
        if not isinstance(value, tp):
            hint = (
                f"; a mapping of fields: build_run_config(base={{'{name}': ...}})"
                if isinstance(value, Mapping)
                else ""
            )
            raise ConfigError(name, f"expected a {tp.__name__}, got {brief(value)}{hint}")


@functools.cache
def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    return {
        f.name: tp for f in fields(RunConfig) if isinstance(tp := hints[f.name], type) and is_dataclass(tp)
    }


def check_tensor_parallel(model: ModelConfig, tp_size: int) -> None:
    """Tensor parallel splits whole attention heads and MLP columns, and sequence parallel the context: each count
    must divide by `tp_size`. (The vocabulary is checked
    once the dataset has resolved it, by the trainer.)"""
    if tp_size == 1:
        return
    if model.num_experts:
        raise ConfigError(
            "parallel.tp_size", "tensor parallel of mixture-of-experts blocks is not implemented yet; use 1"
        )
    if model.arch != "llama":
        raise ConfigError(
            "parallel.tp_size", f"tensor parallel is implemented for arch llama, not {model.arch}; use 1"
        )
    for name, value in (
        ("model.num_heads", model.num_heads),
        ("model.num_kv_heads", model.kv_heads),
        ("model.ffn_dim", model.hidden_dim),
        ("model.context_length", model.context_length),
    ):
        if value % tp_size:
            raise ConfigError(
                "parallel.tp_size", f"{tp_size} must divide {name} ({value}); allowed: a divisor of {value}"
            )


def _check_expert_parallel(model: ModelConfig, ep_size: int) -> None:
    """Expert parallel places num_experts / ep_size whole experts on each rank: the count must divide. (Checked
    before the refusal below, so a config that could never work says why.)"""
    if ep_size == 1:
        return
    if not model.num_experts:
        raise ConfigError(
            "parallel.ep_size", f"{ep_size} needs a mixture of experts (model.num_experts); use 1"
        )
    if model.num_experts % ep_size:
        raise ConfigError(
            "parallel.ep_size",
            f"{ep_size} does not divide model.num_experts ({model.num_experts}) evenly; allowed: a divisor of "
            f"{model.num_experts}",
        )
    raise ConfigError("parallel.ep_size", "expert parallel is not implemented yet; use 1")


def _batch_size_from_tokens(global_batch_tokens: int, context_length: int) -> int:
    """Sequences per optimizer step for a global batch stated in tokens; it must be whole sequences."""
    if global_batch_tokens % context_length:
        below = global_batch_tokens // context_length * context_length
        nearest = " or ".join(str(v) for v in (below, below + context_length) if v > 0)
        raise ConfigError(
            "train.global_batch_tokens",
            f"{global_batch_tokens} is not divisible by model.context_length ({context_length}); "
            f"nearest valid: {nearest}",
        )
    return global_batch_tokens // context_length


def _fill_batch_size_from_tokens(raw: dict[str, Any]) -> None:
    """A global batch stated only in tokens becomes `train.global_batch_size` before the sections are built.

    This runs on the raw dict because only here is a user-set `global_batch_size` told apart from its default
    (12); when both are set, `RunConfig.__post_init__` checks that they agree, which also keeps a saved resolved
    config (both fields, consistent) loadable as is.
    """
    train_raw = raw.get("train")
    if not isinstance(train_raw, Mapping) or "global_batch_size" in train_raw:
        return
    if train_raw.get("global_batch_tokens") is None:
        return
    # Typed and validated the same way the full build will do it, so a bad value gets the usual one-line error.
    tokens = from_dict(
        TrainConfig, {"global_batch_tokens": train_raw["global_batch_tokens"]}, prefix="train"
    ).global_batch_tokens
    assert tokens is not None
    context_length = from_dict(ModelConfig, raw["model"], prefix="model").context_length
    raw["train"] = {**train_raw, "global_batch_size": _batch_size_from_tokens(tokens, context_length)}


def _check_steps_or_epochs(raw: Mapping[str, Any]) -> None:
    """`train.max_epochs` and `train.max_steps` are alternatives. Told apart from max_steps' default only here, on
    the raw dict (as `_fill_batch_size_from_tokens` does for the batch). `max_steps: null` beside max_epochs is
    max_steps left unset (`_drop_unset_steps`)."""
    train_raw = raw.get("train")
    if (
        isinstance(train_raw, Mapping)
        and train_raw.get("max_epochs") is not None
        and train_raw.get("max_steps") is not None
    ):
        raise ConfigError(
            "train.max_epochs",
            f"{train_raw['max_epochs']!r} and train.max_steps {train_raw['max_steps']!r} are both set; they are "
            "alternatives: set one (max_epochs = passes over the training tokens, max_steps = optimizer steps)",
        )


def _drop_unset_steps(raw: dict[str, Any]) -> dict[str, Any]:
    """`max_steps: null` with max_epochs set (what `--train.max_epochs 1 --train.max_steps null` says): the steps
    come from the epochs, so the field takes its default instead of failing as "expected an integer, got None"."""
    train_raw = raw.get("train")
    if (
        isinstance(train_raw, Mapping)
        and train_raw.get("max_epochs") is not None
        and ("max_steps" in train_raw and train_raw["max_steps"] is None)
    ):
        raw = {**raw, "train": {k: v for k, v in train_raw.items() if k != "max_steps"}}
    return raw


def per_rank_checkpoints(parallel: ParallelConfig) -> str | None:
    """The setting that makes every rank write its part of each checkpoint: a sharded (DCP) one (`sharded_by`) or
    DeepSpeed's ZeRO partitions; None where rank 0 writes it alone (DDP, one process)."""
    if parallel.strategy.startswith("deepspeed"):
        return f"parallel.strategy {parallel.strategy}"
    return sharded_by(parallel)


def sharded_by(parallel: ParallelConfig) -> str | None:
    """The setting that makes the run save sharded (DCP) checkpoints: FSDP, or the FSDP2 mesh of pipeline, tensor
    parallel or HSDP; None for single-file ones."""
    if parallel.strategy in ("fsdp", "fsdp_grad_op"):
        return f"parallel.strategy {parallel.strategy}"
    for name in ("pp_size", "tp_size", "dp_replicate"):
        if getattr(parallel, name) > 1:
            return f"parallel.{name} {getattr(parallel, name)} (FSDP2)"
    return None


def steps_for_epochs(max_epochs: int, *, train_tokens: int, tokens_per_step: int) -> int:
    """Optimizer steps that read the training tokens `max_epochs` times: windows are drawn at random offsets
    without replacement (data.sampler), so an epoch covers the split in expectation, as nanoGPT-style samplers do."""
    return max(1, math.ceil(max_epochs * train_tokens / tokens_per_step))


def _pretrained_name(model_raw: Mapping[str, Any]) -> str:
    """The default model (and run) name with `model.init_from`: the checkpoint directory's name when it can name a
    run directory, else the default preset's."""
    name = Path(str(model_raw["init_from"])).name
    try:
        check_name("model.name", name)
    except ConfigError:
        return ModelConfig().name
    return name


def _fill_from_pretrained(raw: dict[str, Any], model_raw: Mapping[str, Any]) -> None:
    """`model.init_from`: the model's shape from the checkpoint's config (fields the user set must agree), and the
    tokenizer beside it for the data unless `data.tokenizer` is set (then that one is used, and the trainer checks
    that its vocabulary fits the checkpoint's)."""
    from gaudi3_scale.models.pretrained import pretrained_model_fields, tokenizer_beside

    init_from = raw["model"]["init_from"]
    if not isinstance(init_from, str) or not init_from:
        raise ConfigError("model.init_from", f"expected a directory path, got {init_from!r}")
    check_no_credentials("model.init_from", init_from)  # read here, before `from_dict` checks every string
    raw["model"] = {**raw["model"], **pretrained_model_fields(init_from, model_raw)}
    data_raw = raw.get("data") or {}
    tokenizer = tokenizer_beside(init_from)
    if isinstance(data_raw, Mapping) and "tokenizer" not in data_raw and tokenizer is not None:
        raw["data"] = {**data_raw, "tokenizer": str(tokenizer)}


def build_run_config(
    config_path: str | Path | None = None,
    overrides: Sequence[Override] = (),
    base: Mapping[str, Any] | None = None,
) -> RunConfig:
    """YAML file (optional) → dotted overrides → model preset expansion → batch in tokens → validated RunConfig.

    `overrides`: `(key, value)` pairs or `"key=value"` strings (`config.core.apply_overrides`)."""
    from gaudi3_scale.models.registry import get_model_config

    user: dict[str, Any] = load_yaml(config_path) if config_path is not None else {}
    user = apply_overrides(RunConfig, user, overrides)
    _check_steps_or_epochs(user)  # what the user set, not `base` (a whole config, every field present)
    raw = _drop_unset_steps(merge_mappings(dict(base or {}), user))
    model_raw = raw.get("model") or {}
    if not isinstance(model_raw, Mapping):
        raise ConfigError("model", f"expected a mapping of fields, got {model_raw!r}")
    pretrained = model_raw.get("init_from") is not None
    preset_name = model_raw.get("name", _pretrained_name(model_raw) if pretrained else ModelConfig().name)
    if not isinstance(preset_name, str):
        raise ConfigError("model.name", f"expected a string, got {preset_name!r}")
    try:
        preset = to_dict(get_model_config(preset_name))
    except ValueError as exc:
        if not pretrained:
            raise ConfigError("model.name", str(exc)) from None
        # With init_from the checkpoint is the preset: its config gives the shape, the defaults the rest.
        preset = to_dict(ModelConfig(name=preset_name))
    raw["model"] = merge_mappings(preset, model_raw)
    if raw["model"].get("init_from") is not None:
        _fill_from_pretrained(raw, model_raw)
    raw.setdefault("name", preset_name)  # runs/<preset>/ unless the run is named
    _fill_batch_size_from_tokens(raw)
    return from_dict(RunConfig, raw)


def resolve_config(
    config_path: str | None,
    overrides: Sequence[str],
    *,
    out_dir: str | os.PathLike[str] | None = None,
    resume: str | os.PathLike[str] | None = None,
) -> RunConfig:
    """The run config of `--config FILE`, `--section.field VALUE` overrides, `--out` and `--resume` (`gaudi3 train`
    and its workers)."""
    pairs: list[Override] = [*parse_overrides(list(overrides))]
    if out_dir is not None:
        pairs.append(("out_dir", out_dir))
    if resume is not None:
        pairs.append(("train.resume", resume))
    return build_run_config(config_path, pairs)


def config_dict(cfg: RunConfig) -> dict[str, Any]:
    """`cfg` as a config file holds it (`--print-config`, tune's best.yaml, a deploy's run.yaml): with
    train.max_epochs set, max_steps is null, as its value is a placeholder until the data is opened and a file that
    sets both is refused (`_check_steps_or_epochs`)."""
    raw: dict[str, Any] = to_dict(cfg)
    if cfg.train.max_epochs is not None:
        raw["train"]["max_steps"] = None
    return raw


def config_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (`--print-config`), which `--config` reads back."""
    import yaml

    return yaml.safe_dump(config_dict(cfg), sort_keys=False)


def throwaway_run_overrides(*, spike_policy: str) -> list[str]:
    """What a short run made to measure a config (a tuning trial, a plan probe, a benchmark cell) turns off, as
    `gaudi3 train` flags: a length in epochs (its length is its own steps, which it sets), the profiler (its steps
    would be measured, and its window may lie past the short run's last step: refused), checkpoints (and what acts
    only on them, `checkpoints_off_overrides`: a spike `rollback`, `spike_policy`, warns instead), tracker runs (one
    per trial in the user's W&B/MLflow), the metrics port (the real run may hold it: every trial would crash) and
    the cost budget (a measurement spends nothing worth stopping)."""
    from gaudi3_scale.checkpoint.config import checkpoints_off_overrides

    return [
        "--train.max_epochs=null",
        "--train.profile_start_step=null",
        *checkpoints_off_overrides(spike_policy=spike_policy),
        "--monitor.loggers=",
        "--monitor.metrics_port=null",
        "--cost.budget_usd=null",
    ]
