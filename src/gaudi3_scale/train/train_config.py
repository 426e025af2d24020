"""The `train` section of the run config: batch, steps, validation, precision (fp8's options among it), device,
compilation, threads, spot watching, resume and profiling — what the trainer (`train.trainer`) runs by."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from gaudi3_scale.config.core import check_field_types, check_positive
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.config.numbers import INT32_MAX, check_number, check_seconds
from gaudi3_scale.config.urls import check_http_url
from gaudi3_scale.device.float8 import SKIP_SMALL_RECIPES, Float8Recipe
from gaudi3_scale.train.spot import AWS_SPOT_URL

__all__ = ["FP8_OPTIONS", "CompileMode", "Precision", "TrainConfig", "fp8_option_defaults"]

Precision = Literal["auto", "32-true", "bf16-mixed", "bf16-true", "16-mixed", "fp8"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


@dataclass(kw_only=True)
class TrainConfig:
    global_batch_size: int = field(
        default=12, metadata={"help": "sequences per optimizer step, all ranks together"}
    )
    global_batch_tokens: int | None = field(
        default=None,
        metadata={
            "help": "tokens per optimizer step, all ranks together; when set, "
            "global_batch_size = global_batch_tokens / model.context_length"
        },
    )
    micro_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "sequences per forward pass per rank; null = global batch / data-parallel ranks (no "
            "accumulation), or 1 under pipeline parallel (each sequence a pipeline micro-batch)"
        },
    )
    max_steps: int = field(
        default=2000, metadata={"help": "optimizer steps to train (or set train.max_epochs instead)"}
    )
    max_epochs: int | None = field(
        default=None,
        metadata={
            "help": "passes over the training tokens, an alternative to train.max_steps: the run trains "
            "ceil(max_epochs × train tokens / tokens per step) optimizer steps, resolved when the data is opened "
            "(the saved config then holds that max_steps); null = use max_steps"
        },
    )
    val_every_steps: int = field(
        default=250, metadata={"help": "validate every N optimizer steps; 0 = only at end"}
    )
    val_batches: int = field(
        default=20, metadata={"help": "micro-batches of held-out windows per validation"}
    )
    log_every_steps: int = field(default=10, metadata={"help": "write metrics.jsonl every N optimizer steps"})
    precision: Precision = field(
        default="auto",
        metadata={
            "help": "auto = 32-true on CPU, bf16-mixed on GPUs that support it; fp8 = bf16-mixed with torchao "
            "float8 linears (NVIDIA compute capability >= 8.9, the fp8 extra)"
        },
    )
    fp8_recipe: Float8Recipe = field(
        default="tensorwise",
        metadata={
            "help": "only with precision fp8: torchao's float8 scaling recipe. tensorwise = one scale per tensor "
            "(cuBLAS; torchao's default, its fastest); rowwise = one scale per row, rounded to a power of two "
            "(more accurate; CUTLASS kernel, Hopper sm_90 in PyTorch); rowwise_with_gw_hp = rowwise with the "
            "weight gradient computed in high precision, torchao's most accurate recipe: for runs whose loss "
            "drifts from bf16"
        },
    )
    fp8_head: bool = field(
        default=False,
        metadata={
            "help": "only with precision fp8: convert the output head too (when its sizes are multiples of 16). "
            "Off by default: its logits feed the softmax over the whole vocabulary, where "
            "FP8 rounding reaches the loss most directly. On is faster: the head of Llama 3.2 1B is ~21 % of its "
            "6N FLOPs"
        },
    )
    fp8_skip_small_linears: bool = field(
        default=False,
        metadata={
            "help": "only with precision fp8 and the tensorwise or rowwise recipe: keep in bf16 the linears that "
            "torchao's H100 GEMM tables find slower in fp8 (its auto filter; opt-in), e.g. the "
            "2048 -> 512 key/value projections of Llama 3.2 1B under tensorwise"
        },
    )
    device: Literal["auto", "cpu", "cuda", "hpu"] = field(
        default="auto",
        metadata={"help": "where to train; hpu = Intel Gaudi (not yet validated on Gaudi hardware)"},
    )
    compile: bool = field(
        default=False,
        metadata={"help": "torch.compile the model together with its loss (one compiled region)"},
    )
    compile_mode: CompileMode = field(
        default="default",
        metadata={
            "help": "torch.compile mode: reduce-overhead also captures CUDA graphs (CUDA only; for small models "
            "whose steps are bound by kernel launches), max-autotune also searches kernel configurations"
        },
    )
    tf32: bool = field(
        default=True,
        metadata={"help": "TF32 tensor cores for fp32 matmuls and convolutions on CUDA GPUs that have them"},
    )
    throughput_warmup_steps: int | None = field(
        default=None,
        metadata={
            "help": "first optimizer steps of each process left out of the summary's tokens/s, MFU and step "
            "time (reported as warmup_s); null = 2, or 5 with train.compile, at most max_steps - 1"
        },
    )
    hpu_graphs: bool = field(
        default=False,
        metadata={
            "help": "Gaudi only: record and replay HPU graphs (switches on lazy mode); not yet validated on "
            "Gaudi hardware"
        },
    )
    deterministic: bool = field(default=False, metadata={"help": "use only deterministic kernels"})
    threads: int | None = field(
        default=None, metadata={"help": "intra-op CPU threads per process; null = physical cores / ranks"}
    )
    spot_watch: bool = field(
        default=False,
        metadata={"help": "poll spot_url for a spot-interruption notice; on one, checkpoint and exit 143"},
    )
    spot_url: str = field(
        default=AWS_SPOT_URL,
        metadata={"help": "instance-metadata URL of the interruption notice (AWS default)"},
    )
    spot_poll_s: float = field(default=5.0, metadata={"help": "seconds between spot-notice polls"})
    resume: str = field(
        default="auto",
        metadata={
            "help": "auto = continue from the newest checkpoint in the output directory if there is one; "
            "never = start fresh (refused when checkpoints exist); or a checkpoint path"
        },
    )
    allow_data_change: bool = field(
        default=False,
        metadata={
            "help": "resume even though the prepared data's content (its shard checksums) differs from what the "
            "checkpoint was trained on"
        },
    )
    profile_start_step: int | None = field(
        default=None,
        metadata={
            "help": "record optimizer steps from this one (counted from 0) with torch.profiler into <out>/profile/ "
            "(a Chrome trace per rank and a summary, named by the window); null = off"
        },
    )
    profile_num_steps: int = field(default=5, metadata={"help": "optimizer steps the profiler records"})

    def __post_init__(self) -> None:
        # ints are ints, as from YAML: `TrainConfig(max_steps=2.5)` or `max_steps=None` is refused here
        check_field_types(self)
        for name in ("global_batch_size", "max_steps", "val_batches", "log_every_steps"):
            check_positive(name, getattr(self, name))
        check_positive("val_every_steps", self.val_every_steps, allow_zero=True)
        check_positive("max_epochs", self.max_epochs)
        check_positive("global_batch_tokens", self.global_batch_tokens)
        check_positive("micro_batch_size", self.micro_batch_size)
        check_number("threads", self.threads, low=1, high=INT32_MAX)  # torch.set_num_threads takes a C int
        check_seconds("spot_poll_s", self.spot_poll_s)
        check_http_url("spot_url", self.spot_url)
        check_positive("profile_num_steps", self.profile_num_steps)
        check_positive("profile_start_step", self.profile_start_step, allow_zero=True)
        steps_known = self.max_epochs is None  # else max_steps is a placeholder until the data is opened
        if (
            steps_known
            and self.profile_start_step is not None
            and self.profile_start_step + self.profile_num_steps > self.max_steps
        ):
            raise ConfigError(
                "profile_start_step",
                f"steps {self.profile_start_step}..{self.profile_start_step + self.profile_num_steps - 1} go past "
                f"the last step, {self.max_steps - 1} (train.max_steps {self.max_steps}); lower the start or the count",
            )
        check_positive("throughput_warmup_steps", self.throughput_warmup_steps, allow_zero=True)
        if (
            steps_known
            and self.throughput_warmup_steps is not None
            and self.throughput_warmup_steps >= self.max_steps
        ):
            raise ConfigError(
                "throughput_warmup_steps",
                f"{self.throughput_warmup_steps} leaves no measured step of train.max_steps {self.max_steps}; "
                f"allowed: 0 to {self.max_steps - 1}, or null for the default rule",
            )
        _check_fp8_options(self)
        if self.compile_mode != "default" and not self.compile:
            raise ConfigError(
                "compile_mode",
                f"{self.compile_mode} is a torch.compile mode; set train.compile true as well, or leave it default",
            )
        if self.micro_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                "micro_batch_size",
                f"must divide global_batch_size ({self.global_batch_size}), got {self.micro_batch_size}",
            )

    def resolved_throughput_warmup_steps(self) -> int:
        """The warm-up steps left out of steady-state throughput (see `monitor.clock`)."""
        if self.throughput_warmup_steps is not None:
            return self.throughput_warmup_steps
        from gaudi3_scale.monitor.clock import default_throughput_warmup_steps

        return min(default_throughput_warmup_steps(compile=self.compile), self.max_steps - 1)


# TrainConfig fields that act only with precision fp8
FP8_OPTIONS = ("fp8_recipe", "fp8_head", "fp8_skip_small_linears")


def fp8_option_defaults() -> dict[str, Any]:
    """The `train.fp8_*` fields at their defaults: what a run in another precision holds (the tuner's)."""
    return {f.name: f.default for f in fields(TrainConfig) if f.name in FP8_OPTIONS}


def _check_fp8_options(train: TrainConfig) -> None:
    """An fp8 option set for a run that is not fp8 would be silently ignored: refuse it, naming the field."""
    if train.precision == "fp8":
        if train.fp8_skip_small_linears and train.fp8_recipe not in SKIP_SMALL_RECIPES:
            raise ConfigError(
                "fp8_skip_small_linears",
                f"true needs a recipe torchao has size thresholds for ({', '.join(SKIP_SMALL_RECIPES)}), "
                f"not train.fp8_recipe {train.fp8_recipe}",
            )
        return
    for name, default in fp8_option_defaults().items():
        value = getattr(train, name)
        if value != default:
            shown = str(value).lower() if isinstance(value, bool) else value
            raise ConfigError(
                name,
                f"{shown} applies only with train.precision fp8, not {train.precision} (it would be ignored); "
                f"set train.precision fp8 or leave {name} at its default, {str(default).lower()}",
            )
