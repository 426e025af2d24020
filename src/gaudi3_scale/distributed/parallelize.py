"""Parallelism applied to a single-device model from the outside, in one place and in torchtitan's order:
tensor parallel → float8 linears → activation checkpointing → (HPU graphs) → compile → FSDP (or HSDP), driven by a
resolved `ParallelPlan`, on the device mesh the strategy builds (`distributed.mesh`). What changes the model on one
device (float8, checkpointing, HPU graphs) is `apply_single_device`, which `memory.MemoryOptimizer` calls too.

DDP and DeepSpeed need nothing here: their Lightning strategies wrap the module, and what they do at gradient
boundaries is `distributed.grad_sync`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gaudi3_scale.device.hpu import apply_hpu_graphs, require_hpu
from gaudi3_scale.distributed.mesh import PP_DIM, TP_DIM, data_parallel_mesh
from gaudi3_scale.distributed.pipeline import Pipeline, build_stage_modules
from gaudi3_scale.distributed.plan import ParallelPlan
from gaudi3_scale.distributed.tensor_parallel import apply_tensor_parallel, local_loss, step_context
from gaudi3_scale.models import ModelConfig, build_model
from gaudi3_scale.models.build import model_class
from gaudi3_scale.models.transformer import Transformer

__all__ = [
    "Parallelized",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "apply_single_device",
    "build_parallelized",
    "find_blocks",
    "parallelize",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Parallelized:
    """The model with the plan applied, and its `(tokens, targets) -> loss` function (compiled with the plan's
    `compile`; call it, not the model, to train). A step's forward and backward run inside `step_context()`
    (loss parallel under tensor parallel, see `distributed.tensor_parallel`)."""

    model: nn.Module
    loss_fn: LossFn
    step_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    # Under pipeline parallel: this rank's stages and their schedule, which runs a step's micro-batches
    # (`model` then holds the stages' modules, and `loss_fn` is the pipeline's forward-only loss).
    pipeline: Pipeline | None = None


def parallelize(
    model: nn.Module,
    plan: ParallelPlan,
    *,
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    mesh: Any = None,
    device: torch.device | str | None = None,
    init_weights: Callable[[nn.Module], None] | None = None,
) -> Parallelized:
    """Apply `plan` to a freshly built single-device `model`; `loss(model, tokens, targets)` is the objective.

    `mesh` is the device mesh of a sharding strategy (`distributed.mesh`): tensor parallel splits the model over its
    `tensor_parallel` dimension, FSDP shards over its data-parallel dimensions (two of them, replicate × shard, is
    HSDP). Parameter names, and therefore checkpoints, are the same whatever the plan applies.

    A model built on the meta device (shapes only) is materialised last: after sharding, each rank allocates only
    its shards on `device` and `init_weights(model)` fills them — with a layout-independent init
    (`models.common.init`) the weights are bitwise those of a model built whole.
    """
    if plan.tp_size > 1:
        if mesh is None:
            raise ValueError("tensor parallel splits the model over a device mesh; the strategy provides it")
        apply_tensor_parallel(model, mesh[TP_DIM])
    apply_single_device(model, plan)

    def loss_fn(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return local_loss(loss(model, tokens, targets))

    if plan.compile:
        # The loss goes inside the compiled region: Inductor then fuses the head's log-softmax with the logits'
        # fp32 upcast instead of materialising fp32 logits for the whole batch. On an H100 (GPT-2 124M,
        # micro-batch 32, 2026-11-25) compiling the model alone gave 80.5 ms/step and a 29.4 GB peak; with the
        # loss inside, 68.1 ms and 15.1 GB, as fast as nanoGPT's train.py. torch.compile traces at the first call,
        # so it sees the model as laid out here, HPU graphs and FSDP included.
        mode = None if plan.compile_mode == "default" else plan.compile_mode
        backend = plan.compile_backend  # Inductor, or Habana's graph compiler on Gaudi (device.hpu)
        if plan.pipelined:
            # A pipeline's schedule runs the stage module itself, micro-batch by micro-batch, between its sends
            # and receives, and computes the loss apart: each block is compiled on its own (nn.Module.compile: the
            # parameter names, and so checkpoints, stay those of the whole model), as torchtitan compiles the
            # blocks of its pipeline stages. The embeddings, the final norm and the head run eagerly.
            for block in find_blocks(model):
                block.compile(mode=mode, backend=backend)
        else:
            loss_fn = torch.compile(loss_fn, mode=mode, backend=backend)
    if plan.shards_parameters:
        if mesh is None:
            raise ValueError(f"{plan.strategy} shards over a device mesh; the strategy provides it")
        dp_mesh = data_parallel_mesh(mesh)
        # Tensor parallel alone (one data-parallel rank) has nothing to shard: FSDP would only copy each
        # parameter into its all-gather buffer and back. Its mixed-precision policy and CPU offload still need it.
        # (Pipeline stages alone are sharded over their one rank all the same: their parameters are then DTensors,
        # which Lightning's sharded checkpoint loading looks for.)
        offload = plan.offload == "all"
        if plan.tp_size == 1 or dp_mesh.size() > 1 or plan.bf16_params or offload:
            apply_fsdp(
                model,
                dp_mesh,
                reshard_after_forward=plan.reshard_after_forward,
                param_dtype=torch.bfloat16 if plan.bf16_params else None,
                offload=offload,
            )
    if any(p.is_meta for p in model.parameters()):
        if device is None or init_weights is None:
            raise ValueError("a model built on meta needs a device and init_weights to be materialised")
        _materialize(model, device, init_weights, offload=plan.shards_parameters and plan.offload == "all")
    return Parallelized(model, loss_fn, step_context(plan.tp_size > 1))


def _materialize(
    model: nn.Module, device: torch.device | str, init_weights: Callable[[nn.Module], None], *, offload: bool
) -> None:
    """Allocate a meta model's storage and initialise it. Under FSDP2 CPU offload the parameter shards live on the
    host (FSDP copies each block's to the device for its all-gather), so they are allocated there; buffers (the
    RoPE cache) are read by the forward on the device and go there (torchtitan does the same)."""
    model.to_empty(device="cpu" if offload else device)
    init_weights(model)
    if offload:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))  # stays a buffer, persistent or not as registered


def apply_single_device(model: nn.Module, plan: ParallelPlan, *, max_hpu_graphs: int = 10) -> int:
    """What `plan` changes on the model itself, in place and in order: float8 linears, activation checkpointing,
    HPU graphs (Habana's ModuleCacher keeping up to `max_hpu_graphs`); returns how many blocks are checkpointed.

    HPU graphs need Gaudi: off Gaudi the refusal comes before anything changes.
    """
    if plan.hpu_graphs:
        require_hpu()
    if plan.float8 is not None:
        from gaudi3_scale.device.float8 import apply_float8

        apply_float8(
            model,
            recipe=plan.float8.recipe,
            head=plan.float8.head,
            skip_small_linears=plan.float8.skip_small_linears,
        )
    blocks = apply_activation_checkpointing(model) if plan.activation_checkpointing else 0
    if plan.hpu_graphs:
        apply_hpu_graphs(model, max_graphs=max_hpu_graphs)
    return blocks


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's list of repeated blocks: its `layers` (ours, Llama-style), else the largest `nn.ModuleList` whose
    items all share one class (`transformer.h` in GPT-2-style models)."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return layers
    candidates = [
        module
        for module in model.modules()
        if isinstance(module, nn.ModuleList) and len(module) and len({type(item) for item in module}) == 1
    ]
    if not candidates:
        raise ValueError(
            f"activation checkpointing needs a model with a ModuleList of repeated blocks; "
            f"{type(model).__name__} has none"
        )
    return max(candidates, key=len)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute every transformer block in backward (Chen et al. 2016, "Training Deep Nets with Sublinear Memory");
    returns how many blocks.

    The block's `forward` is replaced on the instance, not wrapped in another module, so parameter names — and
    therefore checkpoints — are the same with and without activation checkpointing.
    """
    layers = find_blocks(model)
    for block in layers:
        original = block.forward
        if getattr(original, "activation_checkpointed", False):
            continue  # applied already: checkpointing twice would recompute twice

        def checkpointed(*args: Any, _forward: Any = original, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = functools.wraps(original)(checkpointed)
        block.forward.activation_checkpointed = True  # type: ignore[attr-defined]
    return len(layers)


def apply_fsdp(
    model: nn.Module,
    mesh: Any,
    *,
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None = None,
    offload: bool = False,
) -> None:
    """FSDP2 `fully_shard` per transformer block, then the root (embeddings, final norm, head), over `mesh`: 1-D
    shards over all its ranks; 2-D (replicate, shard) is HSDP — sharded within a row, replicated across rows.

    reshard_after_forward=True frees gathered parameters after each block's forward and gathers them again for
    backward (ZeRO-3); False keeps them until backward (ZeRO-2 style: gradients and optimizer state sharded).
    The tied GPT-2 embedding/head live in the root unit together, as tying requires.

    offload=True is FSDP2's `CPUOffloadPolicy` (`parallel.offload all`): parameter shards, their gradients and so
    the optimizer step live in host memory; each block's shards are copied to the device for its all-gather.
    Pinned host memory (faster copies) needs an accelerator: torch refuses to pin without one ("Cannot access
    accelerator device when none is available", torch 2.13 CPU), so a CPU mesh offloads unpinned.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    from gaudi3_scale.distributed.shard_plan import fsdp_shard_dim

    policy = (
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    )
    shards = mesh.size(-1)  # the shard dimension of a (replicate, shard) mesh; the whole of a 1-D one

    def placement(param: nn.Parameter) -> Any:
        dim = fsdp_shard_dim(tuple(param.shape), shards)
        return Shard(dim) if dim else None  # None: FSDP2's default, dim 0

    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "shard_placement_fn": placement,
    }
    if policy is not None:
        kwargs["mp_policy"] = policy
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError("FSDP needs a model with a `layers` ModuleList of blocks")
    for block in layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def build_parallelized(
    model_cfg: ModelConfig,
    plan: ParallelPlan,
    *,
    seed: int,
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    mesh: Any = None,
    device: torch.device | str | None = None,
    init_weights: Callable[..., None] | None = None,
    micro_batches: int = 1,
) -> Parallelized:
    """A registry model laid out by `plan`, initialised from `seed`: built whole when nothing is sharded; under FSDP
    built on meta, sharded, and materialised shard by shard on `device`; under ZeRO-3 partitioned module by module
    as it is built — the same weights every way.

    `init_weights(model, gathered=None)` (e.g. `models.pretrained_reader.load_pretrained`) fills the weights instead
    of the seeded init; the model is then built on meta whatever the plan (on `device`, default CPU), so no random
    init is wasted. Under ZeRO-3 it gets `gathered`, the context that makes one module's partitioned parameters
    whole while it writes them.
    """
    if plan.partitions_parameters:
        from gaudi3_scale.distributed.deepspeed import gathered_for_update

        # Under the strategy's `zero.Init` (Lightning opens it around configure_model) every module is partitioned
        # as it is built; the init then gathers one module at a time. Outside it this is a plain whole build.
        model = model_class(model_cfg)(model_cfg)
        if init_weights is None:
            model.init_weights(seed, gathered=gathered_for_update)
        else:
            init_weights(model, gathered=gathered_for_update)
        return parallelize(model, plan, loss=loss)
    if plan.pipelined:
        return _build_pipelined(model_cfg, plan, seed=seed, loss=loss, mesh=mesh, device=device,
                                init_weights=init_weights, micro_batches=micro_batches)  # fmt: skip
    if init_weights is None and not plan.shards_parameters:
        return parallelize(build_model(model_cfg, seed=seed), plan, loss=loss)
    with torch.device("meta"):
        model = build_model(model_cfg)
    fill = init_weights or (lambda built: model.init_weights(seed))
    return parallelize(model, plan, loss=loss, mesh=mesh, device=device or "cpu", init_weights=fill)


def _build_pipelined(
    model_cfg: ModelConfig,
    plan: ParallelPlan,
    *,
    seed: int,
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    mesh: Any,
    device: torch.device | str | None,
    init_weights: Callable[..., None] | None,
    micro_batches: int,
) -> Parallelized:
    """This rank's pipeline stages (`distributed.pipeline`), each laid out by `plan` as a whole model would be and
    materialised on `device` with only its own weights: seeded (names make the init layout-independent) or read
    by `init_weights`."""
    if mesh is None:
        raise ValueError("pipeline parallel runs on a device mesh; the strategy provides it")
    with torch.device("meta"):
        whole = build_model(model_cfg)
    assert isinstance(whole, Transformer), "refused by the config: pipeline stages split a decoder's layers"
    holder, stages, indices = build_stage_modules(
        whole, schedule=plan.pp_schedule, pp_size=plan.pp_size, pp_rank=mesh[PP_DIM].get_local_rank(),
        split=plan.pp_split,
    )  # fmt: skip
    target = torch.device(device or "cpu")
    for stage in stages:
        fill = init_weights or (lambda built: built.init_weights(seed))
        parallelize(stage, plan, loss=loss, mesh=mesh, device=target, init_weights=fill)
    pipeline = Pipeline(
        modules=stages,
        indices=indices,
        num_stages=plan.pp_size * len(indices),
        schedule_name=plan.pp_schedule,
        n_microbatches=micro_batches,
        mesh=mesh,
        device=target,
        loss=loss,
    )
    return Parallelized(holder, pipeline.eval_loss, step_context(plan.tp_size > 1), pipeline)
