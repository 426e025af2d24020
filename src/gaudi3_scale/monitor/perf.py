"""Throughput arithmetic shared by training, benchmarks and (later) the Prometheus exporter."""

from __future__ import annotations

import resource
import sys

import torch

__all__ = ["mfu", "peak_memory_bytes"]


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


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated accelerator memory on CUDA; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes
