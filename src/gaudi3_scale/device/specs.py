"""Accelerator peak throughput as data, each number with its source. Unknown is absent, never invented.

These peaks are the denominators of MFU (model FLOPs utilization, PaLM paper, Chowdhery et al. 2022, App. B).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ACCELERATORS", "AcceleratorSpec", "find_accelerator"]


@dataclass(frozen=True, kw_only=True)
class AcceleratorSpec:
    name: str
    match: tuple[str, ...]  # lower-case substrings of the device name reported by the runtime
    bf16_dense_tflops: float
    fp8_dense_tflops: float | None
    memory_gb: float
    source: str


_STAS = "github.com/stas00/ml-engineering compute/accelerator/README.md (snapshot 2026-08-22)"

ACCELERATORS: dict[str, AcceleratorSpec] = {
    spec.name: spec
    for spec in (
        AcceleratorSpec(
            name="h100-sxm",
            match=("h100 80gb hbm3", "h100 sxm"),
            bf16_dense_tflops=989.4,
            fp8_dense_tflops=1978.9,
            memory_gb=80,
            source="NVIDIA H100 datasheet via glennklockwood.com/garden/processors/h100; " + _STAS,
        ),
        AcceleratorSpec(
            name="h200-sxm",
            match=("h200",),
            bf16_dense_tflops=989.0,
            fp8_dense_tflops=1979.0,
            memory_gb=141,
            source=_STAS + " (same compute as H100 SXM)",
        ),
        AcceleratorSpec(
            name="a100-sxm",
            match=("a100-sxm", "a100 sxm"),
            bf16_dense_tflops=312.0,
            fp8_dense_tflops=None,
            memory_gb=80,
            source="NVIDIA A100 datasheet via glennklockwood.com/garden/processors/A100",
        ),
        AcceleratorSpec(
            name="gaudi2",
            match=("gaudi2", "gaudi 2"),
            bf16_dense_tflops=432.0,
            fp8_dense_tflops=865.0,
            memory_gb=96,
            source="Intel, Hot Chips 2024 (R. Kaplan); " + _STAS,
        ),
        AcceleratorSpec(
            name="gaudi3",
            match=("gaudi3", "gaudi 3"),
            # 1835 is the spec; the part ships at a 1600 MHz MME clock, which gives 1677 (stas00, same source).
            bf16_dense_tflops=1677.0,
            fp8_dense_tflops=1677.0,
            memory_gb=128,
            source="Intel, Hot Chips 2024 (R. Kaplan); effective clock from " + _STAS,
        ),
        AcceleratorSpec(
            name="mi300x",
            match=("mi300x",),
            bf16_dense_tflops=1300.0,
            fp8_dense_tflops=2610.0,
            memory_gb=192,
            source=_STAS,
        ),
    )
}


def find_accelerator(device_name: str) -> AcceleratorSpec | None:
    """The spec whose match strings occur in `device_name`, or None when we have no sourced number for it."""
    lowered = device_name.lower()
    for spec in ACCELERATORS.values():
        if any(m in lowered for m in spec.match):
            return spec
    return None
