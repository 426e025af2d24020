"""Pick the device and precision a run uses, and the peak FLOP/s that MFU is measured against."""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.device.float8 import check_float8_supported
from gaudi3_scale.device.specs import AcceleratorSpec, find_accelerator

__all__ = [
    "DevicePlan",
    "check_device_precision",
    "cpu_model_name",
    "cpu_threads_per_rank",
    "detected_hpu_name",
    "gaudi_present",
    "hpu_precision",
    "measure_cpu_matmul_flops",
    "measured_cpu_spec",
    "plan_device",
    "resolve_device",
    "usable_cpu_cores",
]


@dataclass(frozen=True, kw_only=True)
class DevicePlan:
    accelerator: str  # "cpu" or "cuda" (Lightning accelerator names)
    precision: str  # Lightning precision string
    device_name: str
    peak_flops: float | None  # FLOP/s per device that MFU divides by; None = unknown
    peak_source: str
    # train.precision fp8: swap the eligible linears for torchao's Float8Linear (device/float8.py); `precision`
    # is then the bf16-mixed that Lightning runs around them.
    float8: bool = False

    @property
    def precision_name(self) -> str:
        """The precision as the run config names it (fp8 runs hold bf16-mixed for Lightning)."""
        return "fp8" if self.float8 else self.precision


def usable_cpu_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's share, not the host's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


def cpu_threads_per_rank(ranks_per_node: int) -> int:
    """A CPU run's intra-op threads per rank when `train.threads` is unset: the usable cores shared by its ranks."""
    return max(1, usable_cpu_cores() // ranks_per_node)


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=8)
def measure_cpu_matmul_flops(threads: int, *, seconds: float = 0.3) -> float:
    """Best FP32 matmul FLOP/s on this CPU with `threads` threads, measured once per process.

    A CPU has no datasheet peak we can trust (turbo, SMT, AVX frequency offsets), so CPU MFU is reported against
    the measured matmul ceiling, the CPU analogue of stas00's "maximum achievable matmul FLOPS". The run's MFU is
    against this process's measurement, never one read from disk; the forecast's calibration store keeps the best
    of these measurements, as one taken while the machine was busy understates the peak (`forecast.machine`).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 1024
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(3):
            a @ b  # warm-up: thread pool start, packing buffers
        best = 0.0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(previous)
    return best


def measured_cpu_spec(threads: int | None = None) -> AcceleratorSpec:
    """This machine's CPU as a catalog entry: peak = its measured fp32 matmul FLOP/s (all cores by default),
    memory = its RAM, power unknown. The CPU entry of the catalog is always measured, never a datasheet figure."""
    import psutil

    threads = threads or torch.get_num_threads()
    return AcceleratorSpec(
        name="cpu",
        match=(),
        bf16_dense_tflops=measure_cpu_matmul_flops(threads) / 1e12,
        fp8_dense_tflops=None,
        memory_gb=psutil.virtual_memory().total / 1e9,
        memory_bandwidth_tbps=None,
        tdp_w=None,
        source=f"measured on this machine: fp32 matmul peak with {threads} threads on {cpu_model_name()}; "
        "memory = RAM",
    )


def hpu_precision(precision: str) -> str:
    """The precision a Gaudi run trains in (`auto` resolved), or the one-line refusal. Not yet validated on Gaudi
    hardware."""
    if precision == "fp8":
        check_float8_supported("hpu")  # refused on Gaudi, whether or not one is present
    if precision == "16-mixed":
        raise ConfigError("train.precision", "Gaudi trains in bf16; use bf16-mixed, bf16-true or 32-true")
    return "bf16-mixed" if precision == "auto" else precision


def _plan_hpu(precision: str) -> DevicePlan:
    """Not yet validated on Gaudi hardware."""
    precision = hpu_precision(precision)
    from gaudi3_scale.device.hpu import apply_hpu_environment, hpu_environment, require_hpu, torch_hpu

    apply_hpu_environment(hpu_environment())  # before habana_frameworks is first imported
    try:
        require_hpu()
    except UserInputError as exc:
        raise ConfigError("train.device", str(exc)) from None
    return _accelerator_plan("hpu", str(torch_hpu().get_device_name()), precision)


def _cpu_precision(precision: str) -> str:
    """The precision a CPU run trains in (`auto` resolved), or the one-line refusal."""
    if precision == "fp8":
        check_float8_supported("cpu")
    if precision == "16-mixed":
        raise ConfigError(
            "train.precision", "16-mixed needs a GPU; on cpu use 32-true, bf16-mixed or bf16-true"
        )
    return "32-true" if precision == "auto" else precision


def _cuda_precision(precision: str, *, fp16: bool = True) -> tuple[str, str, bool]:
    """(device name, the Lightning precision, float8) of a CUDA run, or the one-line refusal. `fp16`: whether the
    run can train in 16-mixed (not sharded: `train.config`); where it cannot, `auto` on a GPU without bf16 is
    32-true."""
    if not torch.cuda.is_available():
        raise ConfigError(
            "train.device", "cuda was requested but no CUDA device is visible; allowed here: auto, cpu"
        )
    name = torch.cuda.get_device_name()
    bf16_ok = torch.cuda.is_bf16_supported()
    if precision == "auto":
        precision = "bf16-mixed" if bf16_ok else "16-mixed" if fp16 else "32-true"
    if precision == "fp8":
        check_float8_supported("cuda")
        return name, "bf16-mixed", True
    if precision.startswith("bf16") and not bf16_ok:
        raise ConfigError("train.precision", f"{name} has no bf16 support; use 16-mixed or 32-true")
    return name, precision, False


# Device files of the habanalabs driver: /dev/accel/accel<N> since it moved to the kernel's compute-accelerator
# subsystem (Linux drivers/accel/Kconfig: accelerators are "exposed to user-space using different device files,
# called accel/accel*"), /dev/hl<N> before (the driver's first patch: "a /dev/hlX file per PCI device").
HPU_DEVICE_FILES = ("/dev/accel/accel[0-9]*", "/dev/hl[0-9]*")


def _habana_installed() -> bool:
    """Whether habana_frameworks can be imported, found without importing it (its environment must be set first)."""
    return importlib.util.find_spec("habana_frameworks") is not None


def gaudi_present() -> bool:
    """Whether this looks like a Gaudi node: Intel's Gaudi torch (habana_frameworks) installed and accelerator
    device files present. Neither imports habana_frameworks nor starts its runtime, so `train.device auto` can pick
    hpu before the Habana environment is applied. Not yet validated on Gaudi hardware."""
    return _habana_installed() and any(glob.glob(pattern) for pattern in HPU_DEVICE_FILES)


def resolve_device(device: str) -> str:
    """`train.device` as a run trains on it: `auto` is a visible CUDA GPU, else a Gaudi (`gaudi_present`), else
    the CPU. Intel's Gaudi torch has no CUDA, so a Gaudi node never resolves to cuda."""
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    return "hpu" if gaudi_present() else "cpu"


# Run in a child process: the Habana runtime a parent opens would hold the cards its trial or probe ranks open next
# (Gaudi runs one process per device), and its environment must be set before habana_frameworks is imported.
_HPU_NAME = (
    "from gaudi3_scale.device.hpu import apply_hpu_environment, hpu_available, hpu_environment, torch_hpu\n"
    "apply_hpu_environment(hpu_environment())\n"
    "print(torch_hpu().get_device_name() if hpu_available() else '')\n"
)


@functools.cache  # one child process per process: the card does not change, and each start loads Habana's runtime
def detected_hpu_name(*, timeout_s: float = 120.0) -> str | None:
    """The name of this node's Gaudi (`torch.hpu.get_device_name()`, e.g. "GAUDI3"), or None when none is usable
    here; asked of a child process, only where `gaudi_present`. A child that fails or hangs counts as no Gaudi
    visible (callers say so: `forecast.run`, `tune.tuner`). Not yet validated on Gaudi hardware."""
    if not gaudi_present():
        return None
    try:
        done = subprocess.run(
            [sys.executable, "-c", _HPU_NAME], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return None
    return lines[-1].strip() or None


def check_device_precision(device: str, precision: str) -> None:
    """`plan_device`'s refusals of a device or precision on this machine, without measuring its peak or starting
    Gaudi's runtime: what a launcher checks before it starts any rank (one line instead of one per rank). Whether
    the Gaudis are usable is left to each rank (`_plan_hpu`): that needs habana_frameworks imported."""
    device = resolve_device(device)
    if device == "hpu":
        if not _habana_installed():
            raise ConfigError(
                "train.device",
                "Gaudi (HPU) was requested but habana_frameworks (Intel's Gaudi PyTorch) is not installed here; "
                "allowed here: auto, cpu" + (", cuda" if torch.cuda.is_available() else ""),
            )
        hpu_precision(precision)
    elif device == "cuda":
        _cuda_precision(precision)
    else:
        _cpu_precision(precision)


def _accelerator_plan(accelerator: str, name: str, precision: str, *, float8: bool = False) -> DevicePlan:
    """MFU peak from the sourced spec table; bf16 tensor-core peaks do not apply to fp32 runs (left unknown).

    An fp8 run is measured against the BF16 dense peak too, as torchtitan does (its `get_peak_flops` is the BF16
    peak whatever the float8 setting): the model FLOPs are the same, so fp8 and bf16 MFU compare directly and a
    speed-up shows as a higher MFU. Against the FP8 peak (twice the BF16 one on Hopper) the same run would read half.
    `peak_source` says which peak was used and gives the FP8 one for conversion.
    """
    spec = find_accelerator(name)
    peak = spec.bf16_dense_tflops * 1e12 if spec and precision != "32-true" else None
    source = spec.source if spec and peak else "unknown"
    if float8 and spec and peak:
        fp8 = f"{spec.fp8_dense_tflops:g} TFLOP/s" if spec.fp8_dense_tflops else "unknown"
        source = f"BF16 dense peak, used for fp8 runs too so they compare with bf16 (FP8 dense peak {fp8}); {source}"
    return DevicePlan(
        accelerator=accelerator,
        precision=precision,
        device_name=name,
        peak_flops=peak,
        peak_source=source,
        float8=float8,
    )


def plan_device(device: str, precision: str, *, threads: int, fp16: bool = True) -> DevicePlan:
    """Resolve `auto` choices; refuse combinations the hardware cannot run (one line, the field named). `fp16`:
    whether `auto` may resolve to 16-mixed (on a GPU without bf16), False for runs that shard their parameters.

    `precision="fp8"` (torchao float8 linears) runs on CUDA GPUs of compute capability 8.9 or newer with torchao
    installed: the plan holds Lightning's "bf16-mixed" and `float8=True`. Elsewhere it is refused.
    """
    device = resolve_device(device)
    if device == "hpu":
        return _plan_hpu(precision)
    if device == "cuda":
        name, precision, float8 = _cuda_precision(precision, fp16=fp16)
        return _accelerator_plan("cuda", name, precision, float8=float8)
    return DevicePlan(
        accelerator="cpu",
        precision=_cpu_precision(precision),
        device_name=cpu_model_name(),
        peak_flops=measure_cpu_matmul_flops(threads),
        peak_source=f"measured fp32 matmul peak with {threads} threads",
    )
