"""HPU data parallelism over Habana's `hccl` backend: Lightning's DDP, registered as "habana_ddp", and our FSDP2
strategy (FSDP, HSDP and tensor-parallel meshes; the mesh's device type is the root device's, "hpu").

Not yet validated on Gaudi hardware.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from gaudi3_scale.device.hpu import load_hccl
from gaudi3_scale.distributed.fsdp import FSDPStrategy

__all__ = ["HPUDDPStrategy", "HPUFSDPStrategy", "register_hpu_strategies"]


class HPUDDPStrategy(DDPStrategy):
    strategy_name = "habana_ddp"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("process_group_backend", "hccl")
        super().__init__(**kwargs)

    def setup_environment(self) -> None:
        load_hccl()  # registers the hccl backend before the process group is created
        super().setup_environment()


class HPUFSDPStrategy(FSDPStrategy):
    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("process_group_backend", "hccl")
        super().__init__(**kwargs)

    def setup_environment(self) -> None:
        load_hccl()  # registers the hccl backend before the process group and the device mesh are created
        super().setup_environment()


def register_hpu_strategies() -> None:
    if HPUDDPStrategy.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(
            HPUDDPStrategy.strategy_name, HPUDDPStrategy, description="DDP over HCCL on Intel Gaudi"
        )
