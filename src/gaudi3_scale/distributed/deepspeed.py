"""DeepSpeed ZeRO-2/3 under Lightning on every accelerator DeepSpeed runs on — CPU with gloo included.

Lightning's `DeepSpeedStrategy` refuses anything but CUDA, yet the DeepSpeed engine itself trains on CPU with gloo.
`ZeroStrategy` lifts that check and keeps the rest of Lightning's integration (engine setup, backward and step through
the engine, bf16 config). Two things differ on purpose:

* ZeRO-3 builds the model under `deepspeed.zero.Init`: each module's parameters are partitioned as soon as the
  module is constructed, so no rank ever holds the whole model. They are then initialised one module at a time
  under `GatheredParameters` with the layout-independent init (`models.common.init`), so every strategy and world
  size starts from bitwise the same weights as one process.
* Checkpoints use our single-file format: the full (consolidated) model state dict that one process can load, like
  every other strategy's, plus each rank's ZeRO optimizer partition so that a resume at the same world size is exact.

DeepSpeed is an optional dependency: `pip install 'gaudi3-scale[deepspeed]'`.
"""

from __future__ import annotations

import argparse
import enum
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.distributed.plan import ZERO_OVERLAP_COMM

__all__ = ["ZeroStrategy", "build_zero_strategy", "gathered_for_update", "skip_inference_comm_build"]

_STAGE = {"deepspeed_zero2": 2, "deepspeed_zero3": 3}
_PARTITIONS = "zero_partitions"  # optimizer_states[0] key: one ZeRO optimizer state per rank


_DROP = object()


def _plain(value: Any) -> Any:
    """Tensors, numbers, strings and containers of them, so the checkpoint loads with weights_only=True.

    DeepSpeed's optimizer state also holds objects (its loss scaler, enums, fragment mappings) that it rebuilds or
    does not need when it loads a partition; enums become their values, other objects are left out.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, int | float | str | bool):
        return value
    if isinstance(value, list | tuple):
        items = [_plain(v) for v in value]
        return _DROP if any(v is _DROP for v in items) else items
    if isinstance(value, Mapping):
        pairs = {k: _plain(v) for k, v in value.items()}
        return {k: v for k, v in pairs.items() if v is not _DROP}
    return _DROP


def _offload_config(offload: str, stage: int, *, pin_memory: bool) -> dict[str, Any]:
    """`zero_optimization` entries for `parallel.offload` (DeepSpeed "ZeRO-Offload", Ren et al. 2021,
    arXiv:2101.06840; parameters too with stage 3, "ZeRO-Infinity"): optimizer state and its step on the CPU, and
    for "all" the fp16/bf16 parameter partitions as well. Pinned buffers speed host-device copies; with gloo there is
    no device to copy to."""
    if offload == "none":
        return {}
    host = {"device": "cpu", "pin_memory": pin_memory}
    out = {"offload_optimizer": dict(host)}
    if offload == "all":
        assert stage == 3, "distributed.config refuses offload all with ZeRO-2"
        out["offload_param"] = dict(host)
    return out


def skip_inference_comm_build() -> None:
    """Keep DeepSpeed's comm backend from compiling its shared-memory all-reduce op when it starts.

    On CPU, DeepSpeed's TorchBackend JIT-compiles `deepspeed_shm_comm` (a C++ op: 50 s of the first 2-rank ZeRO run
    on this 2-core machine, 2026-11-26) for `inference_all_reduce`, which training never calls: every reduction of
    a training step goes through torch.distributed. Marked incompatible, the op is skipped. DeepSpeed caches its
    `__compatible_ops__` dict once per process, so the mark holds for this process's backend.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class ZeroStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO stage 2 or 3 with our accumulation, clipping and checkpoint format."""

    strategy_name = "gaudi3_zero"

    def __init__(
        self,
        stage: int,
        *,
        micro_batch_size: int,
        accumulation: int,
        grad_clip_norm: float,
        hidden_size: int,
        process_group_backend: str,
        offload: str = "none",
        timeout: timedelta = default_pg_timeout,
    ) -> None:
        prefetch = 0 if process_group_backend == "gloo" else int(0.9 * hidden_size**2)
        config = {
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_clipping": grad_clip_norm,
            "zero_optimization": {
                "stage": stage,
                "contiguous_gradients": True,
                # zero.Init would otherwise swap F.linear for its own matmul + bias autograd function, which rounds
                # differently from the fused addmm every other strategy runs (2-rank ZeRO-3 losses drifted 1e-5
                # from one process's within 3 steps).
                "memory_efficient_linear": False,
                "overlap_comm": ZERO_OVERLAP_COMM,
                # DeepSpeed's defaults (5e8-element buckets, 2 GB in fp32) dwarf small models; these are the
                # hidden-size rules Hugging Face's DeepSpeed integration uses for its "auto" values.
                "reduce_bucket_size": hidden_size**2,
                "allgather_bucket_size": hidden_size**2,
                # Prefetching overlaps gathers with GPU compute; with gloo on CPU there is nothing to overlap.
                "stage3_prefetch_bucket_size": prefetch,
                # DeepSpeed's 1e9 defaults keep every gathered parameter that backward will reuse, i.e. the whole
                # model through forward (+0.4 GB per rank on the GPT-2-124M shape, measured). Two blocks' worth
                # (a block is ~12·h² parameters) re-gathers per block, as FSDP's reshard_after_forward does.
                "stage3_max_live_parameters": 24 * hidden_size**2,
                "stage3_max_reuse_distance": 24 * hidden_size**2,
                "stage3_param_persistence_threshold": 10 * hidden_size,
                # ZeRO-3 steps the optimizer one sub-group at a time; its 1e9-element default stages fp32
                # gradients for the whole partition at once.
                "sub_group_size": 16 * hidden_size**2,
                **_offload_config(offload, stage, pin_memory=process_group_backend != "gloo"),
            },
            "zero_allow_untested_optimizer": True,
            # parallel.offload: our AdamW (torch's fused kernel, on CPU tensors) steps the offloaded fp32 partitions,
            # the same optimizer as every other strategy. DeepSpeed would insist on its own DeepSpeedCPUAdam, a
            # C++ op compiled at first use (105 s on this 2-core machine, 2026-11-26).
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 2**62,  # DeepSpeed's own step log would interleave with ours
            "wall_clock_breakdown": False,
        }
        super().__init__(config=config, process_group_backend=process_group_backend, timeout=timeout)
        self.stage = stage
        self.accumulation = accumulation

    # -- setup -----------------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips DeepSpeedStrategy's CUDA-only check

    def setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        # DeepSpeedStrategy first checks CUDA device indices against local ranks; CPU devices have no index.
        reset_seed()
        self.set_world_ranks()
        skip_inference_comm_build()
        self._init_deepspeed_distributed()

    def teardown(self) -> None:
        # Lightning never destroys the engine: its ZeRO optimizer's gradient hooks keep the model's parameters, and
        # they keep the process group (`distributed.teardown`). Destroyed while the group is still up: it logs
        # through it.
        engine: Any = self.model
        if hasattr(engine, "destroy") and torch.distributed.is_initialized():
            engine.destroy()
            if self.stage == 3:
                _release_zero3_globals(engine.module)
        super().teardown()

    def _format_batch_size_and_grad_accum_config(self) -> None:
        # The LightningModule accumulates (manual optimization); the engine learns the boundary from it.
        assert isinstance(self.config, dict)
        self.config["gradient_accumulation_steps"] = self.accumulation

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
        import deepspeed

        # Lightning passes root_device.index, which is None on CPU; DeepSpeed wants an int.
        index = self.root_device.index if self.root_device.index is not None else self.local_rank
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=index),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        if self.stage < 3:
            yield  # built whole, as in one process
            return
        import deepspeed

        # Lightning opens this around configure_model: parameters are partitioned module by module as they are
        # built (the module then initialises them through `gathered_for_update`).
        with deepspeed.zero.Init(config_dict_or_path=self.config, enabled=True):
            yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # Lightning runs the whole training_step inside the engine's forward. Ours also runs backward and the
        # optimizer step, and ZeRO-3 then kept every gathered parameter alive until that outer forward ended
        # (+0.4 GB per rank on the GPT-2-124M shape). The module calls the engine for the forward pass only.
        assert self.lightning_module is not None
        with self.precision_plugin.train_step_context():
            return self.lightning_module.training_step(*args, **kwargs)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        if self.stage < 3:
            return module.state_dict()
        import deepspeed

        # Every rank takes part in the gather; the full tensors are copied out before they are partitioned again.
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        local = _plain(self.deepspeed_engine.optimizer.state_dict())
        gathered: list[Any] | None = [None] * self.world_size if self.is_global_zero else None
        torch.distributed.gather_object(local, gathered, dst=0)
        return {_PARTITIONS: gathered, "zero_stage": self.stage, "world_size": self.world_size}

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        DDPStrategy.save_checkpoint(self, checkpoint, filepath, storage_options)  # rank 0 writes one file

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return DDPStrategy.load_checkpoint(self, checkpoint_path, weights_only)

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.stage < 3:
            module = self.lightning_module
            assert module is not None
            module.load_state_dict(checkpoint["state_dict"], strict=strict)
        else:
            self._restore_zero_state(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        (saved,) = checkpoint["optimizer_states"]
        if _PARTITIONS not in saved:
            raise UserInputError(
                "this checkpoint was not written by a DeepSpeed strategy; resume it with the strategy that wrote it"
            )
        if saved["world_size"] != self.world_size or saved["zero_stage"] != self.stage:
            raise UserInputError(
                f"this checkpoint holds ZeRO-{saved['zero_stage']} optimizer partitions for {saved['world_size']} "
                f"ranks; resume it with deepspeed_zero{saved['zero_stage']} on {saved['world_size']} ranks"
            )
        optimizer = self.deepspeed_engine.optimizer
        partitions = [dict(p) for p in saved[_PARTITIONS]]
        for part in partitions:
            # Left out at save (an object); without fp16 loss scaling it carries no state, so the live one serves.
            part.setdefault("loss_scaler", optimizer.loss_scaler)
        # The fp32 master partitions come from the checkpoint, not from the (possibly bf16) module weights.
        optimizer.load_state_dict(partitions, load_optimizer_states=True, load_from_fp32_weights=True)


def _release_zero3_globals(module: torch.nn.Module) -> None:
    """What DeepSpeed 0.19's ZeRO-3 keeps of a destroyed engine's model in module-level state."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    # Setup puts the engine's module at the bottom of the forward stack, and destroy() leaves it there.
    stack = parameter_offload.FWD_MODULE_STACK
    stack[:] = [m for m in stack if m is not module]
    # The coordinator's release plan is an lru_cache on the class (inside an NVTX wrapper), keyed by coordinator,
    # and a coordinator holds the model's modules: a cache, cleared for every engine alike.
    plan = getattr(
        PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__params_to_release", None
    )
    for cached in [plan, *(cell.cell_contents for cell in getattr(plan, "__closure__", None) or ())]:
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def gathered_for_update(params: list[torch.nn.Parameter]) -> Any:
    """A context under which ZeRO-3 partitioned `params` are whole and what rank 0 writes into them is kept (every
    rank writes the same values); a no-op for parameters DeepSpeed does not partition."""
    if not any(hasattr(p, "ds_id") for p in params):
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def build_zero_strategy(
    name: str,
    *,
    accelerator: str,
    backend: str,
    micro_batch_size: int,
    accumulation: int,
    grad_clip_norm: float,
    hidden_size: int,
    offload: str = "none",
    timeout: timedelta = default_pg_timeout,
) -> ZeroStrategy:
    # DeepSpeed picks its accelerator once, at import; tell it ours instead of letting it probe.
    os.environ.setdefault("DS_ACCELERATOR", accelerator)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise UserInputError(
            f"parallel.strategy {name} needs DeepSpeed: pip install 'gaudi3-scale[deepspeed]'"
        ) from None
    return ZeroStrategy(
        _STAGE[name],
        micro_batch_size=micro_batch_size,
        accumulation=accumulation,
        grad_clip_norm=grad_clip_norm,
        hidden_size=hidden_size,
        process_group_backend=backend,
        offload=offload,
        timeout=timeout,
    )
