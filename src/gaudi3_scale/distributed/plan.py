"""How the work of one optimizer step is split, resolved once per run: `BatchPlan` (who reads how many sequences
when) and `ParallelPlan` (what is applied to the model, and by which strategy).

Both are computed from the run config by the trainer and handed to everything that needs them — the module, the
data module, the Lightning strategy, benchmark cells and the tuner — so the arithmetic and the strategy name are
worked out in one place (torchtitan's `ParallelDims` plays this role there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.device.float8 import Float8Plan
from gaudi3_scale.distributed.config import STRATEGIES, ParallelConfig

__all__ = [
    "CUDA_GRAPH_COMPILE_MODES",
    "SHARDED_STRATEGIES",
    "ZERO_OVERLAP_COMM",
    "ZERO_STAGES",
    "BatchPlan",
    "ParallelPlan",
    "data_parallel_size",
]

# torch.compile modes that capture CUDA graphs (the step then marks each new iteration for the graph trees).
CUDA_GRAPH_COMPILE_MODES = frozenset({"reduce-overhead", "max-autotune"})
SHARDED_STRATEGIES = ("fsdp", "fsdp_grad_op")  # FSDP2 fully_shard, applied by `parallelize`
ZERO_STAGES = ("deepspeed_zero2", "deepspeed_zero3")  # DeepSpeed's engine wraps the module
# DeepSpeed's `zero_optimization.overlap_comm`, as `distributed.deepspeed` sets it (and the forecast reads it): off,
# the gradient reductions run on the compute stream (DeepSpeed's stage_1_and_2.py and stage3.py reduce on the
# default stream then), so backward waits for each of them.
ZERO_OVERLAP_COMM = False


def data_parallel_size(world_size: int, tp_size: int = 1, pp_size: int = 1) -> int:
    """Ranks that read different data: `world_size` ranks in tensor-parallel groups of `tp_size` and pipelines of
    `pp_size` stages, each group × pipeline reading one batch (HSDP's replicas and shards are both data-parallel)."""
    model_parallel = tp_size * pp_size
    if tp_size < 1 or pp_size < 1 or world_size % model_parallel:
        raise ValueError(
            f"world_size {world_size} is not a multiple of tp_size {tp_size} × pp_size {pp_size}"
        )
    return world_size // model_parallel


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """One optimizer step's batch: ``global_batch_size = micro_batch_size × accumulation × data_parallel_size``.

    Every data-parallel rank runs `accumulation` micro-steps of `micro_batch_size` sequences each; the step trains
    on `tokens_per_step` tokens. A data-parallel rank is a tensor-parallel group × a pipeline: its `tp_size ×
    pp_size` ranks read the same batch, so `data_parallel_size = world_size / (tp_size × pp_size)`. Under pipeline
    parallel the `accumulation` micro-batches are the pipeline's micro-batches (`distributed.pipeline`).
    """

    global_batch_size: int
    micro_batch_size: int
    accumulation: int
    data_parallel_size: int
    context_length: int = 0  # tokens per sequence; 0 = not known here (tokens_per_step is then 0)

    @classmethod
    def build(
        cls,
        *,
        global_batch_size: int,
        micro_batch_size: int | None,
        data_parallel_size: int,
        context_length: int = 0,
    ) -> BatchPlan:
        """The plan for a global batch; `micro_batch_size` None = the whole per-rank batch (no accumulation).

        A global batch that does not split into whole micro-batches on every rank is a `ConfigError`.
        """
        _check_split(global_batch_size, micro_batch_size, data_parallel_size)
        micro = micro_batch_size or global_batch_size // data_parallel_size
        return cls(
            global_batch_size=global_batch_size,
            micro_batch_size=micro,
            accumulation=global_batch_size // (micro * data_parallel_size),
            data_parallel_size=data_parallel_size,
            context_length=context_length,
        )

    @classmethod
    def from_micro_batch(
        cls,
        micro_batch_size: int,
        *,
        accumulation: int = 1,
        data_parallel_size: int = 1,
        context_length: int = 0,
    ) -> BatchPlan:
        """The plan of `accumulation` micro-batches of `micro_batch_size` sequences on each data-parallel rank: the
        global batch follows (what a memory what-if or a hand-written loop knows). Not checked: the estimator
        refuses a micro-batch below 1 with the field's name."""
        return cls(
            global_batch_size=micro_batch_size * accumulation * data_parallel_size,
            micro_batch_size=micro_batch_size,
            accumulation=accumulation,
            data_parallel_size=data_parallel_size,
            context_length=context_length,
        )

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.context_length

    @property
    def per_rank_batch_size(self) -> int:
        """Sequences one rank trains on per optimizer step (micro-batch × accumulation)."""
        return self.micro_batch_size * self.accumulation


def _check_split(global_batch_size: int, micro_batch_size: int | None, data_parallel_size: int) -> None:
    """A `ConfigError` naming the smallest step when the global batch does not split into whole micro-batches."""
    step = (micro_batch_size or 1) * data_parallel_size
    if global_batch_size >= step and not global_batch_size % step:
        return
    ranks = f"{data_parallel_size} data-parallel ranks"
    if micro_batch_size is None:
        problem = (
            f"{global_batch_size} sequences are fewer than the {ranks} (each rank needs at least one)"
            if global_batch_size < step
            else f"{global_batch_size} is not divisible by the {ranks}"
        )
    elif global_batch_size < step:
        problem = (
            f"{global_batch_size} sequences are fewer than train.micro_batch_size {micro_batch_size} × {ranks} = "
            f"{step} (each rank needs at least one micro-batch)"
        )
    else:
        problem = (
            f"{global_batch_size} is not divisible by micro_batch_size ({micro_batch_size}) × ranks "
            f"({data_parallel_size}) = {step}"
        )
    raise ConfigError("train.global_batch_size", f"{problem}; allowed: a multiple of {step}")


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """What `parallelize` applies to a single-device model, in torchtitan's order, and which strategy runs it.

    `strategy` is resolved: single, ddp, fsdp, fsdp_grad_op, deepspeed_zero2 or deepspeed_zero3 (never auto).
    `float8` (None = off) swaps eligible linears for torchao's Float8Linear with its recipe, and the output head
    too if it says so (device.float8); `hpu_graphs` wraps the model in Gaudi HPU graphs (device.hpu). `bf16_params`
    is FSDP's mixed-precision policy for bf16-mixed runs: bf16 parameters for compute, fp32 gradient reduction.
    """

    strategy: str = "single"
    world_size: int = 1
    activation_checkpointing: bool = False
    compile: bool = False
    compile_mode: str = "default"
    # TorchDynamo's backend for `compile`: Inductor, or Habana's on Gaudi (device.hpu.HPU_COMPILE_BACKEND)
    compile_backend: str = "inductor"
    float8: Float8Plan | None = None
    hpu_graphs: bool = False
    bf16_params: bool = False
    tp_size: int = (
        1  # tensor-parallel ranks per replica (Llama attention heads and MLP columns split over them)
    )
    dp_replicate: int = 1  # HSDP replicas; the data-parallel ranks are dp_replicate × dp_shard
    offload: str = "none"  # none, optimizer or all (distributed.config.OFFLOAD)
    pp_size: int = 1  # pipeline stages' ranks (outermost mesh dimension)
    pp_schedule: str = "1f1b"  # distributed.config.PP_SCHEDULES
    pp_split: tuple[int, ...] = ()  # layer indices where stages 1, 2, … start; () = an even split

    def __post_init__(self) -> None:
        if self.strategy == "auto":
            raise ValueError(
                "ParallelPlan.strategy is resolved: single, ddp, fsdp, … (see ParallelPlan.build)"
            )
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise UserInputError(f"world_size must be a positive number of ranks, got {self.world_size!r}")
        if self.world_size % (self.tp_size * self.pp_size * self.dp_replicate):
            raise ValueError(
                f"world_size {self.world_size} is not a multiple of tp_size {self.tp_size} × pp_size "
                f"{self.pp_size} × dp_replicate {self.dp_replicate}"
            )

    @classmethod
    def build(
        cls,
        *,
        strategy: str = "auto",
        world_size: int = 1,
        tp_size: int = 1,
        dp_replicate: int = 1,
        pp_size: int = 1,
        **fields: Any,
    ) -> ParallelPlan:
        """The plan for `strategy` as a run config names it (`parallel.strategy`), resolved as a run resolves it:
        auto is fsdp with a pipeline, tensor-parallel or HSDP mesh, ddp with several ranks, else single. A layout the
        run config refuses (pipeline or tensor parallel or HSDP off a mesh strategy, offload the strategy cannot do, a mesh that
        does not divide the ranks) is a `ConfigError` naming the `parallel.*` field. `fields`: the other fields.

        The trainer builds its plan here from the config; the tuner, the layout table and the cost planner build
        their what-if plans the same way.
        """
        if strategy not in STRATEGIES:
            raise ConfigError(
                "parallel.strategy", f"must be one of {', '.join(STRATEGIES)}, got {strategy!r}"
            )
        offload = fields.get("offload", "none")
        mesh = tp_size > 1 or dp_replicate > 1 or pp_size > 1
        if mesh or offload != "none":
            _check_layout(strategy, world_size, tp_size, dp_replicate, offload, pp_size)
        if strategy == "auto":
            strategy = "fsdp" if mesh else "ddp" if world_size > 1 else "single"
        return cls(
            strategy=strategy,
            world_size=world_size,
            tp_size=tp_size,
            dp_replicate=dp_replicate,
            pp_size=pp_size,
            **fields,
        )

    def runs_as(self, device_kind: str) -> str:
        """The strategy that runs this plan on `device_kind`: `gaudi3 train` on one HPU still goes through the HCCL
        DDP strategy (a group of one, the code path of several; lightning-habana, and users' own Trainers here, use
        a single-device strategy: `distributed.hpu.SingleHPUStrategy`); everywhere else the plan's own."""
        return "ddp" if self.strategy == "single" and device_kind == "hpu" else self.strategy

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different data (each a tensor-parallel group of `tp_size` ranks × a pipeline)."""
        return data_parallel_size(self.world_size, self.tp_size, self.pp_size)

    @property
    def pipelined(self) -> bool:
        """The model is split into pipeline stages (`distributed.pipeline`)."""
        return self.pp_size > 1

    @property
    def dp_shard(self) -> int:
        """Ranks each parameter is sharded over by FSDP (within one HSDP replica)."""
        return self.data_parallel_size // self.dp_replicate

    @property
    def shards_parameters(self) -> bool:
        """FSDP2 shards the model inside `parallelize` (on a device mesh the strategy provides)."""
        return self.strategy in SHARDED_STRATEGIES

    @property
    def reshard_after_forward(self) -> bool:
        """Free gathered parameters after each block's forward (ZeRO-3) rather than keep them for backward.

        Not under pipeline parallel (torchtitan's default there): a stage runs several micro-batches' forwards
        before their backwards, so it would gather every block again for each; and ZBV's weight-gradient pass,
        which runs apart from the input-gradient one, finds a resharded block's gradients lost (measured: PP 2
        ZBV, 1-rank FSDP, grad norm 1.04 instead of 1.57 at step 1)."""
        return self.strategy == "fsdp" and not self.pipelined

    @property
    def uses_deepspeed(self) -> bool:
        return self.strategy in ZERO_STAGES

    @property
    def partitions_parameters(self) -> bool:
        """DeepSpeed ZeRO-3: every parameter is partitioned over all ranks as its module is built (`zero.Init`) and
        gathered module by module to run (hooks TorchDynamo cannot trace) or to be written."""
        return self.strategy == "deepspeed_zero3"

    @property
    def cuda_graphs(self) -> bool:
        """The compiled step captures CUDA graphs (on a CUDA device)."""
        return self.compile and self.compile_mode in CUDA_GRAPH_COMPILE_MODES


def _check_layout(
    strategy: str, world_size: int, tp_size: int, dp_replicate: int, offload: str, pp_size: int = 1
) -> None:
    """The run config's own checks of `parallel.*` against one another, one line naming the field."""
    # nproc_per_node = world_size: a plan is per rank, so only the division of the ranks matters here.
    try:
        ParallelConfig(
            strategy=strategy,  # type: ignore[arg-type]
            tp_size=tp_size,
            dp_replicate=dp_replicate,
            pp_size=pp_size,
            offload=offload,  # type: ignore[arg-type]
            nproc_per_node=world_size,
        )
    except ConfigError as exc:  # named as in a run config
        raise ConfigError(f"parallel.{exc.field}", exc.problem) from None
