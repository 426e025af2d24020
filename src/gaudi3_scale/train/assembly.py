"""What a run sets up and resolves before it builds anything: the process (Lightning's banners quieted, threads),
the device plan (precision), its launch (rank, ranks), the model config resolved against the dataset (vocabulary,
padding) and `train.max_epochs` as optimizer steps.

`GaudiTrainer` calls these in that order, with the sections each one reads; the run config it saves (config.yaml,
the checkpoints' copy) then holds what they resolved, as if the user had set it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.data.config import DataConfig
from gaudi3_scale.data.inputs import TrainingData
from gaudi3_scale.data.mlm import MlmMasking, mlm_vocabulary
from gaudi3_scale.device.select import DevicePlan, cpu_threads_per_rank, plan_device
from gaudi3_scale.distributed.config import ParallelConfig
from gaudi3_scale.models import ModelConfig
from gaudi3_scale.models.counting import check_parameter_count
from gaudi3_scale.train.config import steps_for_epochs
from gaudi3_scale.train.resume import saved_run_config
from gaudi3_scale.train.train_config import TrainConfig

__all__ = [
    "check_device_options",
    "launched_world_size",
    "plan_run_device",
    "quiet_lightning",
    "resolve_model",
    "resolve_padding",
    "steps_of_epochs",
]


def quiet_lightning() -> None:
    """Our progress bar and summary replace Lightning's banner lines ("GPU available…", tips)."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    # Lightning 2.6 calls a pytree API that torch 2.13 deprecates; not ours to fix, and not actionable for users.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=Warning)
    # DeepSpeed calls collectives torch 2.13 renamed, once per bucket: hundreds of identical lines per step.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )


def plan_run_device(train: TrainConfig, *, nproc_per_node: int, fp16: bool = True) -> DevicePlan:
    """Threads, device and precision; run first, so a missing accelerator fails before any data work. `fp16`:
    whether `auto` may resolve to 16-mixed (`device.select.plan_device`)."""
    threads = train.threads or cpu_threads_per_rank(nproc_per_node)
    torch.set_num_threads(threads)
    # Lightning's process launchers reset the thread count unless OMP_NUM_THREADS is set; ours wins.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if train.hpu_graphs:
        os.environ.setdefault("PT_HPU_LAZY_MODE", "1")  # HPU graphs run in lazy mode only
    plan = plan_device(train.device, train.precision, threads=threads, fp16=fp16)
    check_device_options(train, plan.accelerator)
    if plan.accelerator == "cuda" and train.tf32:
        # fp32 matmuls on TF32 tensor cores (Ampere and newer; a no-op before): what 32-true runs and the fp32 parts
        # of mixed precision want on these GPUs (torch's default is full fp32, "highest").
        torch.set_float32_matmul_precision("high")
    return plan


def check_device_options(train: TrainConfig, accelerator: str) -> None:
    """The `train` options one kind of device only runs, refused elsewhere with the field named."""
    if train.hpu_graphs and accelerator != "hpu":
        raise ConfigError(
            "train.hpu_graphs", f"needs Intel Gaudi (train.device hpu), but this run trains on {accelerator}"
        )
    if train.compile_mode == "reduce-overhead" and accelerator != "cuda":
        allowed = "default" if accelerator == "hpu" else "default, max-autotune, max-autotune-no-cudagraphs"
        raise ConfigError(
            "train.compile_mode",
            f"reduce-overhead captures CUDA graphs, which need a CUDA device, but this run trains on "
            f"{accelerator}; allowed here: {allowed}",
        )
    if train.compile and train.compile_mode != "default" and accelerator == "hpu":
        raise ConfigError(
            "train.compile_mode",
            f"{train.compile_mode} tunes Inductor's kernels, and torch.compile on Intel Gaudi runs Habana's graph "
            "compiler (hpu_backend); allowed there: default",
        )


def launched_world_size(parallel: ParallelConfig) -> int:
    """Ranks of this run; several ranks only inside a launched worker (torchrun / `gaudi3 train`)."""
    world = parallel.world_size
    launched = os.environ.get("WORLD_SIZE")
    if world > 1 and launched is None:
        raise UserInputError(
            f"parallel.nproc_per_node × nnodes = {world} needs a launcher: run `gaudi3 train` or "
            "`torchrun -m gaudi3_scale.train`, not GaudiTrainer directly"
        )
    if launched is not None and int(launched) != world:
        raise ConfigError(
            "parallel.nproc_per_node",
            f"the launcher started {launched} ranks but the config asks for {world}",
        )
    return world


def resolve_model(
    model: ModelConfig,
    prepared: TrainingData,
    data: DataConfig,
    *,
    seed: int,
    resume_from: Path | None,
    accelerator: str,
    tp_size: int,
) -> tuple[ModelConfig, MlmMasking | None]:
    """The registry model for this dataset (its vocabulary, padded for the device), checked for size before
    anything is written or built; arch bert also gets its batches' masking."""
    vocab, masking = prepared.vocab_size, None
    if model.arch == "bert":  # MLM: special tokens after the text vocabulary, batches masked (data.mlm)
        mlm = mlm_vocabulary(prepared.tokenizer)
        vocab, masking = mlm.vocab_size, MlmMasking(mlm, data.mlm_mask_rate, seed)
    model = _with_vocabulary(model, vocab)
    model = resolve_padding(model, resume_from, accelerator=accelerator, tp_size=tp_size)
    check_parameter_count(model, "model")
    return model, masking


def _with_vocabulary(model: ModelConfig, vocab: int) -> ModelConfig:
    """`model.vocab_size` left null: the dataset's; set, it must hold the dataset's tokens."""
    if model.vocab_size is None:
        return dataclasses.replace(model, vocab_size=vocab)
    if model.vocab_size >= vocab:
        return model
    if model.init_from is not None:
        raise ConfigError(
            "model.init_from",
            f"{model.init_from} has a vocabulary of {model.vocab_size} tokens but the dataset's tokenizer {vocab}; "
            "allowed: data prepared with its tokenizer (leave data.tokenizer unset)",
        )
    raise ConfigError(
        "model.vocab_size", f"must be >= the dataset's vocabulary ({vocab}), got {model.vocab_size}"
    )


def resolve_padding(
    model: ModelConfig, resume_from: Path | None, *, accelerator: str, tp_size: int
) -> ModelConfig:
    """Vocabulary padding left null: the checkpoint's when resuming (its weights have that many rows, whatever
    device resumes them), else the device default (`ModelConfig.resolve_padding`); under tensor parallel the
    padded rows must split over the tensor-parallel ranks."""
    if model.pad_vocab_to_multiple is None and resume_from is not None:
        saved = (saved_run_config(resume_from) or {}).get("model", {}).get("pad_vocab_to_multiple")
        if saved is not None:
            model = dataclasses.replace(model, pad_vocab_to_multiple=saved)
    resolved = model.resolve_padding(accelerator, tp_size=tp_size)
    if resolved.padded_vocab_size % tp_size:
        raise ConfigError(
            "model.pad_vocab_to_multiple",
            f"the padded vocabulary ({resolved.padded_vocab_size} rows) must split evenly over parallel.tp_size "
            f"{tp_size} (tensor parallel shards the embedding and head by rows); allowed: a multiple of {tp_size}",
        )
    return resolved


def steps_of_epochs(
    train: TrainConfig, prepared: TrainingData, *, tokens_per_step: int, note: Callable[[str], None]
) -> TrainConfig:
    """`train.max_epochs` as optimizer steps over this dataset (all members' training tokens): the config from here
    on, the saved one included, says max_steps (and max_epochs null), as if the user had set it."""
    if train.max_epochs is None:
        return train
    train_tokens = sum(int(sum(m.train.shard_tokens)) for m in prepared.members)
    steps = steps_for_epochs(train.max_epochs, train_tokens=train_tokens, tokens_per_step=tokens_per_step)
    try:  # the fields checked against max_steps (warmup and profiling steps within it) meet the resolved one
        resolved = dataclasses.replace(train, max_steps=steps, max_epochs=None)
    except ConfigError as exc:
        raise ConfigError(
            f"train.{exc.field}", f"{exc.problem} (train.max_epochs {train.max_epochs} gives {steps} steps)"
        ) from None
    note(
        f"train.max_epochs {train.max_epochs}: {steps} optimizer steps ({train_tokens:,} training tokens, "
        f"{tokens_per_step:,} per step)"
    )
    return resolved
