"""FSDP2 (`fully_shard`) through Lightning's ModelParallelStrategy, loading single-file checkpoints correctly.

Lightning's ModelParallelStrategy loads a single-file (DDP or single-process) checkpoint by renumbering the
optimizer state in `named_parameters()` order; `Optimizer.state_dict()` numbers parameters in parameter-group
order, which differs as soon as there is more than one group (weight decay on / off). Here the ids are mapped
through the optimizer's own groups, so a DDP checkpoint resumes under FSDP exactly. Sharded checkpoints load as
in Lightning (DCP, any world size and layout).

The device mesh is ours (`distributed.mesh`): (pipeline, dp_replicate, dp_shard, tensor_parallel), so the same
strategy runs FSDP, HSDP, tensor and pipeline parallel, alone or combined.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from lightning.pytorch.strategies import ModelParallelStrategy

from gaudi3_scale.checkpoint.sharded import optimizer_state_by_name
from gaudi3_scale.distributed.mesh import build_device_mesh, data_parallel_coordinate
from gaudi3_scale.distributed.plan import data_parallel_size

__all__ = ["FSDP2Body", "FSDPStrategy"]

# The body is shared by the strategy of each Lightning namespace (`lightning.pytorch` here, `pytorch_lightning` in
# `distributed.lightning_ns`): a mixin, typed against lightning.pytorch's ModelParallelStrategy for the checker only.
if TYPE_CHECKING:
    _Base = ModelParallelStrategy
else:
    _Base = object


class FSDP2Body(_Base):
    _model_parallel: ClassVar[type]  # the namespace's ModelParallelStrategy, whose own mesh set-up is skipped

    # parallel.offload all: FSDP2 keeps the parameter shards in host memory (distributed.parallelize.apply_fsdp).
    cpu_offload: bool = False

    def model_to_device(self) -> None:
        # Lightning moves the whole module to the device after configure_model; offloaded shards must stay on the
        # host (FSDP2 refuses them elsewhere), and parallelize already put the buffers on the device.
        if not self.cpu_offload:
            super().model_to_device()

    def __init__(self, *, tp_size: int = 1, dp_replicate: int = 1, pp_size: int = 1, **kwargs: Any) -> None:
        super().__init__(tensor_parallel_size=tp_size, **kwargs)
        self.tp_size = tp_size
        self.dp_replicate = dp_replicate
        self.pp_size = pp_size

    def setup_environment(self) -> None:
        # ModelParallelStrategy.setup_environment with our 3-D mesh in place of its (data_parallel, tensor_parallel):
        # ParallelStrategy's (the next class after ModelParallelStrategy), then the mesh
        super(self._model_parallel, self).setup_environment()  # type: ignore[arg-type]
        self._setup_distributed()
        self._data_parallel_size = data_parallel_size(self.world_size, self.tp_size, self.pp_size)
        self._device_mesh = build_device_mesh(
            self.root_device.type,
            world_size=self.world_size,
            tp_size=self.tp_size,
            dp_replicate=self.dp_replicate,
            pp_size=self.pp_size,
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The ranks of a tensor-parallel group, and the stages of a pipeline, read the same data (distributed.mesh).
        replicas, rank = data_parallel_coordinate(
            self.world_size, self.global_rank, self.tp_size, self.pp_size
        )
        return {"num_replicas": replicas, "rank": rank}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        if self.pp_size > 1:  # each rank's groups hold its stages' parameters: list every stage's
            from gaudi3_scale.distributed.mesh import PP_DIM
            from gaudi3_scale.distributed.pipeline import merge_param_groups

            state = merge_param_groups(state, self.device_mesh[PP_DIM].get_group())
        return state

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not path.is_file():
            return super().load_checkpoint(path, weights_only)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        module = self.model
        assert module is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)  # verified
        options = StateDictOptions(full_state_dict=True, strict=strict)  # every rank has the full tensors
        set_model_state_dict(module, checkpoint.pop("state_dict"), options=options)
        for optimizer, state in zip(self.optimizers, checkpoint.pop("optimizer_states", []), strict=True):
            named = optimizer_state_by_name(state, optimizer, module)
            set_optimizer_state_dict(module, optimizer, optim_state_dict=named, options=options)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint, as in ModelParallelStrategy

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass


class FSDPStrategy(FSDP2Body, ModelParallelStrategy):
    _model_parallel = ModelParallelStrategy
