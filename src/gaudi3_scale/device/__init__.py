"""Device detection and accelerator specs. The only package that may import vendor (habana) modules."""

from gaudi3_scale.device.select import DevicePlan, plan_device
from gaudi3_scale.device.specs import ACCELERATORS, AcceleratorSpec, find_accelerator

__all__ = ["ACCELERATORS", "AcceleratorSpec", "DevicePlan", "find_accelerator", "plan_device"]
