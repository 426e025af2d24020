"""Device detection and accelerator specs. The only package that may import vendor (habana) modules.

Names load lazily, so the spec table (`device.specs`) is importable without torch (the cost catalog uses it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gaudi3_scale.lazy import lazy_exports

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

_LAZY = {
    "apply_float8": "gaudi3_scale.device.float8",
    "check_float8_supported": "gaudi3_scale.device.float8",
    "DevicePlan": "gaudi3_scale.device.select",
    "plan_device": "gaudi3_scale.device.select",
    "ACCELERATORS": "gaudi3_scale.device.specs",
    "AcceleratorSpec": "gaudi3_scale.device.specs",
    "find_accelerator": "gaudi3_scale.device.specs",
}

__getattr__ = lazy_exports(__name__, _LAZY)
