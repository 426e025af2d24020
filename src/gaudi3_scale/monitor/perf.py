"""Throughput arithmetic shared by training, benchmarks and the Prometheus exporter (torch imported only where used)."""

from __future__ import annotations

import resource
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["mfu", "mfu_above_peak", "peak_memory_bytes"]


def mfu(
    tokens_per_s: float, flops_per_token: float, peak_flops_per_device: float | None, num_devices: int
) -> float | None:
    """Model FLOPs utilization: achieved model FLOP/s over the peak of all devices.

    PaLM (Chowdhery et al. 2022, Appendix B): MFU = observed tokens/s × model FLOPs per token / peak FLOP/s.
    Activation recomputation is not counted as useful work, so MFU does not change with checkpointing.
    """
    if not peak_flops_per_device or tokens_per_s <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak_flops_per_device * num_devices)


def mfu_above_peak(value: float | None, *, peak_measured: bool = False) -> str | None:
    """What is wrong with an MFU above 1 (model FLOP/s above the devices' peak), or None for a possible value.

    Against a datasheet peak (an accelerator) no device does more, so such a figure is a measuring bug, not a
    result: most often a clock read without a device synchronise (it times kernel launches, not work), else a wrong
    peak or FLOP count. Against a measured peak (`peak_measured`: the CPU's matmul ceiling, measured at start) it
    means the peak was measured while the machine was busy: the MFU is meaningless, tokens/s still holds.
    """
    if value is None or value <= 1.0:
        return None
    if peak_measured:
        return (
            f"MFU {value:.1%} is above the matmul peak measured at start: the machine was busy while it was "
            "measured, so this run's MFU is not meaningful (its tokens/s is)"
        )
    return (
        f"MFU {value:.1%} is above the devices' peak: the timing or the peak is wrong (a clock read without a "
        "device synchronise, a peak for another device), so this run's throughput figures are not results"
    )


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated accelerator memory on CUDA; peak resident set size of this process on CPU."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes
