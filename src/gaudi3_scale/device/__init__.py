"""Device detection and accelerator specs. The only package that may import vendor (habana) modules.

Names load lazily, so the spec table (`device.specs`) is importable without torch (the cost catalog uses it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gaudi3_scale.device.float8 import apply_float8, check_float8_supported
    from gaudi3_scale.device.select import DevicePlan, plan_device
    from gaudi3_scale.device.specs import ACCELERATORS, AcceleratorSpec, find_accelerator

__all__ = [
    "ACCELERATORS",
    "AcceleratorSpec",
    "DevicePlan",
    "apply_float8",
    "check_float8_supported",
    "find_accelerator",
    "plan_device",
]


def __getattr__(name: str) -> Any:
    if name in ("apply_float8", "check_float8_supported"):
        from gaudi3_scale.device import float8

        return getattr(float8, name)
    if name in ("DevicePlan", "plan_device"):
        from gaudi3_scale.device import select

        return getattr(select, name)
    if name in ("ACCELERATORS", "AcceleratorSpec", "find_accelerator"):
        from gaudi3_scale.device import specs

        return getattr(specs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
