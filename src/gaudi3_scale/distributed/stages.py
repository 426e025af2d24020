"""Pipeline stages as arithmetic, no torch: which layers each stage holds, which stages a rank runs, and what the
schedules ask of the micro-batch count. `distributed.pipeline` builds the stages from these; the run config checks
a layout with them before anything is launched.

A model of L layers in S stages (S = pp_size, or 2 × pp_size for the schedules with two stages per rank) is S runs
of consecutive layers; stage 0 also holds the token embeddings, stage S - 1 the final norm and the output head (as
torchtitan's `pipeline_module_split`). Placement of stages on the ranks of the pipeline (torch's
`generate_stage_to_rank_mapping`):

    loop (gpipe, 1f1b, interleaved_1f1b)   stage s on rank s mod pp_size        rank 0: stages 0, pp, …
    v (zbv)                                stages 0 … pp-1 down the ranks, pp … 2pp-1 back up: rank r holds r and
                                           2pp - 1 - r, so rank 0 holds the first and the last stage
"""

from __future__ import annotations

import itertools

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.distributed.config import STAGES_PER_RANK, ParallelConfig
from gaudi3_scale.distributed.plan import CUDA_GRAPH_COMPILE_MODES
from gaudi3_scale.models.config import ModelConfig

__all__ = ["check_micro_batches", "check_pipeline", "local_stages", "stage_layers", "stage_starts"]


def check_pipeline(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    accumulation: int,
    compile_mode: str | None,
    micro_batch_size: int | None = None,
) -> None:
    """A pipeline layout against the model and the run, before launch: one `ConfigError` naming the field.
    `compile_mode`: `train.compile_mode` when `train.compile` is on, else None; `micro_batch_size`: the resolved
    micro-batch (None: not known, the advice then says when a smaller one helps)."""
    if parallel.pp_size == 1:
        return
    if model.arch == "bert" or model.num_experts or model.tie_embeddings:
        what = (
            "an encoder (arch bert)"
            if model.arch == "bert"
            else "a mixture of experts (its router losses join the objective outside the stages)"
            if model.num_experts
            else "tied embedding and head (model.tie_embeddings: they would sit on the first and last stage)"
        )
        raise ConfigError(
            "parallel.pp_size",
            f"pipeline parallel is implemented for decoder-only dense models without tied embeddings, not {what}; "
            "use 1",
        )
    if compile_mode in CUDA_GRAPH_COMPILE_MODES:
        raise ConfigError(
            "train.compile_mode",
            f"{compile_mode} captures CUDA graphs, which a pipeline's sends and receives between the stages' "
            "blocks cannot be part of; with pipeline parallel use default or max-autotune-no-cudagraphs",
        )
    if compile_mode is not None and parallel.pp_schedule == "zbv":
        # ZBV splits each backward in two: the input-gradient pass keeps the graph (`autograd.grad(retain_graph=True)`,
        # torch's `stage_backward_input`) for the weight-gradient pass, and a compiled block's backward donates its
        # buffers, which needs retain_graph=False (torch 2.13: "compiled with non-empty donated buffers").
        raise ConfigError(
            "train.compile",
            "compiled blocks cannot run zbv's split backward (it retains the graph between its input- and "
            "weight-gradient passes); allowed: train.compile with pp_schedule gpipe, 1f1b or interleaved_1f1b, or zbv "
            "with train.compile false",
        )
    stages, per_rank = parallel.pp_stages, STAGES_PER_RANK[parallel.pp_schedule]
    if model.num_layers < stages:
        raise ConfigError(
            "parallel.pp_schedule" if per_rank > 1 else "parallel.pp_size",
            f"{parallel.pp_schedule} with pp_size {parallel.pp_size} runs {stages} stages ({per_rank} per rank), "
            f"more than model.num_layers ({model.num_layers}); allowed: at most {model.num_layers} stages"
            + (" (or a schedule with one stage per rank: gpipe, 1f1b)" if per_rank > 1 else ""),
        )
    if not parallel.pp_split and model.num_layers % stages and per_rank > 1:
        raise ConfigError(
            "parallel.pp_schedule",
            _uneven_two_stage_split(parallel.pp_schedule, parallel.pp_size, model.num_layers, per_rank),
        )
    stage_starts(model.num_layers, stages, parallel.pp_split)
    check_micro_batches(
        parallel.pp_schedule, parallel.pp_size, accumulation, micro_batch_size=micro_batch_size
    )


def _uneven_two_stage_split(schedule: str, pp_size: int, num_layers: int, per_rank: int) -> str:
    """Why the automatic split refuses a schedule with several stages per rank: its stage count comes from the
    schedule, not from pp_size alone (which the world size often fixes)."""
    stages = per_rank * pp_size
    one_stage = " gpipe or 1f1b (one stage per rank)," if num_layers % pp_size == 0 else ""
    return (
        f"{schedule} runs {per_rank} stages per rank, {stages} with pp_size {pp_size}, and the automatic split "
        f"needs model.num_layers ({num_layers}) to be a multiple of them; allowed:{one_stage} parallel.pp_split "
        f"with {stages - 1} layer indices, or a model.num_layers that is a multiple of {stages}"
    )


def stage_starts(num_layers: int, stages: int, split: tuple[int, ...] | list[int] = ()) -> list[int]:
    """The first layer of each of `stages` stages: `split` (the starts of stages 1, 2, …) or an even split.

    A split that does not fit (wrong count, not increasing, outside 1 … num_layers - 1) or layers that do not
    divide evenly is a `ConfigError` naming `parallel.pp_split` or `parallel.pp_size`.
    """
    if split:
        starts = [0, *split]
        if len(split) != stages - 1:
            raise ConfigError(
                "parallel.pp_split",
                f"needs {stages - 1} layer indices (where stages 1 … {stages - 1} start) for {stages} stages, got "
                f"{len(split)}",
            )
        if any(b <= a for a, b in itertools.pairwise(starts)) or starts[-1] >= num_layers:
            raise ConfigError(
                "parallel.pp_split",
                f"must be increasing layer indices between 1 and {num_layers - 1} (model.num_layers - 1), every "
                f"stage at least one layer; got {list(split)}",
            )
        return starts
    if num_layers < stages or num_layers % stages:
        raise ConfigError(
            "parallel.pp_size",
            f"the automatic split needs model.num_layers ({num_layers}) to be a multiple of the {stages} pipeline "
            f"stages; allowed: a pp_size whose stages divide {num_layers}, or set parallel.pp_split",
        )
    per_stage = num_layers // stages
    return [stage * per_stage for stage in range(stages)]


def stage_layers(num_layers: int, stages: int, split: tuple[int, ...] | list[int] = ()) -> list[range]:
    """Each stage's layer indices, in stage order."""
    starts = stage_starts(num_layers, stages, split)
    return [range(a, b) for a, b in zip(starts, [*starts[1:], num_layers], strict=True)]


def local_stages(schedule: str, pp_size: int, pp_rank: int) -> list[int]:
    """The stage indices rank `pp_rank` of the pipeline runs under `schedule`, in order."""
    if STAGES_PER_RANK[schedule] == 1:
        return [pp_rank]
    if schedule == "zbv":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank, pp_rank + pp_size]


def check_micro_batches(
    schedule: str, pp_size: int, accumulation: int, *, micro_batch_size: int | None = None
) -> None:
    """The schedules' own limits on the micro-batch count (the train accumulation), checked before launch with
    the fields a user sets (torch 2.13: `Schedule1F1B` and `ScheduleInterleaved1F1B.__init__`; GPipe and ZBV run
    any count, measured with 2 stages and 1 … 6 micro-batches)."""
    if schedule == "1f1b" and accumulation < pp_size:
        raise ConfigError(
            "parallel.pp_schedule",
            f"1f1b needs at least pp_size ({pp_size}) micro-batches per step, the train accumulation (global batch "
            f"/ (micro-batch × data-parallel ranks)) is {accumulation}; allowed: "
            + _smaller_micro_batch(micro_batch_size)
            + "a larger train.global_batch_size, or pp_schedule gpipe or zbv",
        )
    rounds = max(1, accumulation // pp_size)
    if schedule == "interleaved_1f1b" and accumulation % rounds:
        raise ConfigError(
            "parallel.pp_schedule",
            f"interleaved_1f1b runs the micro-batches in accumulation // pp_size rounds ({rounds}): the train "
            f"accumulation ({accumulation}) must be a multiple of them; allowed: fewer than 2 × pp_size "
            f"({2 * pp_size}) micro-batches or a multiple of pp_size",
        )


def _smaller_micro_batch(micro_batch_size: int | None) -> str:
    """The advice to lower train.micro_batch_size, only where that can raise the micro-batch count."""
    if micro_batch_size is None:
        return "a smaller train.micro_batch_size (when above 1), "
    return "a smaller train.micro_batch_size, " if micro_batch_size > 1 else ""
