"""HPU data parallelism over Habana's `hccl` backend: Lightning's DDP, registered as "habana_ddp", and our FSDP2
strategy (FSDP, HSDP and tensor-parallel meshes; the mesh's device type is the root device's, "hpu"), registered
as "habana_fsdp"; and one HPU (`SingleHPUStrategy`). In lazy mode (PT_HPU_LAZY_MODE=1) every one of them cuts the
accumulated graph after the backward and after the optimizer step (`LazyModeSteps`), as lightning-habana's did.

The classes here are lightning.pytorch's; `distributed.lightning_ns` builds the same ones on `pytorch_lightning`.
Not yet validated on Gaudi hardware.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry

from gaudi3_scale.device.hpu import load_hccl, mark_step
from gaudi3_scale.distributed.fsdp import FSDPStrategy

__all__ = [
    "HABANA_DDP",
    "HABANA_FSDP",
    "HCCLBody",
    "HPUDDPStrategy",
    "HPUFSDPStrategy",
    "LazyModeSteps",
    "SingleHPUStrategy",
    "register_hpu_strategies",
]

HABANA_DDP = "habana_ddp"
HABANA_FSDP = "habana_fsdp"

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

    _Base = DDPStrategy
    _AnyStrategy = Strategy
else:
    _Base = _AnyStrategy = object


class LazyModeSteps(_AnyStrategy):
    """A Lightning strategy on Gaudi that runs the lazily accumulated graph after each backward and each optimizer
    step (`device.hpu.mark_step`: a no-op in eager mode), for users' own LightningModules: lightning-habana's
    strategies did the same (its `on_after_backward` and `optimizer_step`), as Habana's lazy-mode examples do.
    Not yet validated on Gaudi hardware."""

    def post_backward(self, closure_loss: Any) -> None:
        super().post_backward(closure_loss)
        mark_step()  # the forward and backward graph

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        mark_step()  # the optimizer's update
        return output


class SingleHPUStrategy(LazyModeSteps, SingleDeviceStrategy):
    """One HPU (a Trainer with `devices=1` on Gaudi): Lightning's single-device strategy with the lazy-mode steps."""


class HCCLBody(LazyModeSteps, _Base):
    """Any Lightning parallel strategy over hccl: the backend is registered before the process group (and a device
    mesh) is created."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("process_group_backend", "hccl")
        super().__init__(**kwargs)

    def setup_environment(self) -> None:
        load_hccl()
        super().setup_environment()


class HPUDDPStrategy(HCCLBody, DDPStrategy):
    strategy_name = HABANA_DDP


class HPUFSDPStrategy(HCCLBody, FSDPStrategy):
    strategy_name = HABANA_FSDP


def register_hpu_strategies(
    registry: Any = StrategyRegistry, ddp: type = HPUDDPStrategy, fsdp: type = HPUFSDPStrategy
) -> None:
    """ "habana_ddp" and "habana_fsdp" in a Lightning namespace's strategy registry (lightning.pytorch's by default).
    With "habana_fsdp" the LightningModule shards itself in `configure_model`, as under ModelParallelStrategy."""
    for name, cls, description in (
        (HABANA_DDP, ddp, "DDP over HCCL on Intel Gaudi"),
        (HABANA_FSDP, fsdp, "FSDP2 (fully_shard) over HCCL on Intel Gaudi"),
    ):
        if name not in registry:
            registry.register(name, cls, description=description)
