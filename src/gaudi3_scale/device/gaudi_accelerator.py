"""`GaudiAccelerator`: Lightning's Accelerator API for Intel Gaudi, registered as "hpu".

Lightning 2.5.6 removed its HPU support and lightning-habana is archived, so the accelerator lives here.
`pl.Trainer(accelerator=GaudiAccelerator(), devices=8, precision="bf16-mixed", strategy="habana_ddp")` is the
intended use, under `lightning.pytorch` or `pytorch_lightning` (see `distributed.lightning_ns`). Not yet validated on
Gaudi hardware.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry

from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.device.hpu import hpu_available, hpu_device_count, require_hpu

__all__ = ["GaudiAccelerator", "register_gaudi_accelerator"]


class GaudiAccelerator(Accelerator):
    """Intel Gaudi HPUs. Constructing it off Gaudi raises one clear error."""

    def __init__(self) -> None:
        require_hpu()
        super().__init__()

    def setup_device(self, device: torch.device) -> None:
        if device.type != "hpu":
            raise ValueError(f"GaudiAccelerator got a non-HPU device: {device}")

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        import habana_frameworks.torch.hpu as hthpu

        return dict(hthpu.memory_stats(device))

    def teardown(self) -> None:
        pass

    @staticmethod
    def parse_devices(devices: int | str | list[int]) -> int:
        """`Trainer(devices=...)` as a number of HPUs: a positive int up to the HPUs visible here, "auto" or -1 (all
        of them), or the list [0, …, n-1]. Other lists are refused, not reduced to their length: each rank binds the
        card of its local rank (`get_parallel_devices`), so [3, 5] would run on cards 0 and 1."""
        visible = hpu_device_count()
        allowed = f"allowed: 1 to {visible} (the HPUs visible here), 'auto', -1, or the list [0, ..., n-1]"
        if devices in ("auto", -1, "-1"):
            return visible
        if isinstance(devices, list | tuple):
            if list(devices) != list(range(len(devices))) or not devices:
                raise UserInputError(
                    f"devices: {brief(devices)} on Gaudi picks cards, but each rank takes the card of its local "
                    f"rank; {allowed}"
                )
            count = len(devices)
        elif isinstance(devices, int) and not isinstance(devices, bool):
            count = devices
        elif isinstance(devices, str) and devices.strip().isdigit():
            count = int(devices)
        else:
            raise UserInputError(f"devices: {brief(devices)} is not a number of HPUs; {allowed}")
        if count < 1:
            raise UserInputError(f"devices: {count} is not a number of HPUs; {allowed}")
        if count > visible:
            raise UserInputError(
                f"devices: {count} HPUs requested but only {visible} are visible here; {allowed}"
            )
        return count

    @staticmethod
    def get_parallel_devices(devices: int) -> list[torch.device]:
        return [
            torch.device("hpu")
        ] * devices  # HCCL binds one card per process; Lightning sets the local rank

    @staticmethod
    def auto_device_count() -> int:
        return hpu_device_count()

    @staticmethod
    def is_available() -> bool:
        return hpu_available()

    @staticmethod
    def name() -> str:
        return "hpu"

    @classmethod
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        accelerator_registry.register("hpu", cls, description=cls.__name__, override=True)


def register_gaudi_accelerator(
    registry: Any = AcceleratorRegistry, accelerator_base: type | None = None
) -> None:
    """ "hpu" in a Lightning namespace's accelerator registry (lightning.pytorch's by default).

    For another namespace (`pytorch_lightning`), GaudiAccelerator becomes a virtual subclass of that namespace's
    `Accelerator` (an ABC), so its Trainer takes `accelerator=GaudiAccelerator()` as well: the class only answers
    the Accelerator interface, which both namespaces share."""
    if accelerator_base is not None:
        accelerator_base.register(GaudiAccelerator)  # type: ignore[attr-defined]
    if "hpu" not in registry:
        GaudiAccelerator.register_accelerators(registry)
