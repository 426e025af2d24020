"""Host and device readings sampled in the background: CPU, RAM, this rank's memory, NVML GPUs, hl-smi Gaudis.

`SystemSampler` runs one daemon thread that takes a `SystemSample` every `monitor.system_every_s` seconds and
hands it to a callback (the Prometheus exporter). Node-wide readings (host CPU and RAM, every GPU or Gaudi of the
node) are taken by local rank 0 only, so N ranks on a node do not report the same numbers N times; every rank
reports its own process and device memory.

GPUs are read through NVML (`pynvml`, from the nvidia-ml-py package, imported lazily); Gaudis through the
`hl-smi` CSV query. The hl-smi path is **not yet validated on Gaudi hardware**: the query fields are the ones
docs.habana.ai lists for `hl-smi -Q` ("System Management Interface Tool"), and the units are parsed from the
output (an assumption: the same "35 %", "1024 MiB", "220 W", "36 C" style as nvidia-smi; bare numbers are read
as %, MiB, W and °C).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import psutil
import torch

from gaudi3_scale.monitor.perf import peak_memory_bytes

__all__ = [
    "HL_SMI_QUERY",
    "DeviceSample",
    "SystemSample",
    "SystemSampler",
    "device_memory_bytes",
    "parse_hl_smi_csv",
    "query_hl_smi",
    "query_nvml",
]

# Fields of `hl-smi -Q` (docs.habana.ai, "System Management Interface Tool (hl-smi)", --query-aip), in this order.
HL_SMI_QUERY = ("index", "utilization.aip", "memory.used", "memory.total", "power.draw", "temperature.aip")
_HL_SMI_TIMEOUT_S = 10.0

# Unit suffix → (multiply, divide) to the base unit (ratio, bytes, watts); dividing keeps 35 % exactly 0.35.
_UNITS = {
    "%": (1, 100),
    "b": (1, 1),
    "kib": (2**10, 1),
    "mib": (2**20, 1),
    "gib": (2**30, 1),
    "kb": (10**3, 1),
    "mb": (10**6, 1),
    "gb": (10**9, 1),
    "w": (1, 1),
    "mw": (1, 1000),
    "c": (1, 1),  # degrees Celsius
}
_DEFAULT_UNIT = {
    "utilization.aip": "%",
    "memory.used": "mib",
    "memory.total": "mib",
    "power.draw": "w",
    "temperature.aip": "c",
}
_VALUE = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)\s*([A-Za-z%]*)\s*$")


@dataclass(frozen=True)
class DeviceSample:
    """One accelerator of the node; a reading the tool did not give is None."""

    index: int
    utilization_ratio: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None


@dataclass
class SystemSample:
    process_resident_memory_bytes: int
    device_memory_allocated_bytes: int
    device_memory_peak_bytes: int
    host_cpu_utilization_ratio: float | None = None  # node-wide readings: local rank 0 only
    host_memory_used_bytes: int | None = None
    host_memory_total_bytes: int | None = None
    gpus: list[DeviceSample] = field(default_factory=list)
    hpus: list[DeviceSample] = field(default_factory=list)


def device_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(allocated, peak) accelerator memory of this process on `device`.

    CUDA and Gaudi: the allocator's counters. CPU: the process's resident set size now and its peak, since host
    RAM is the device memory there.
    """
    if device.type == "hpu":
        from gaudi3_scale.device.hpu import torch_hpu

        hpu = torch_hpu()
        return int(hpu.memory_allocated(device)), int(hpu.max_memory_allocated(device))
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device)), peak_memory_bytes(device)
    rss = int(psutil.Process().memory_info().rss)
    return rss, max(rss, peak_memory_bytes(device))  # getrusage's peak is KiB-rounded: never below the RSS


def _parse_value(text: str, field_name: str) -> float | None:
    match = _VALUE.match(text)
    if match is None:  # "N/A", "[Not Supported]"
        return None
    number, unit = float(match.group(1)), (match.group(2) or _DEFAULT_UNIT[field_name]).lower()
    if unit not in _UNITS:
        raise ValueError(f"hl-smi {field_name}: unknown unit {unit!r} in {text.strip()!r}")
    multiply, divide = _UNITS[unit]
    return number * multiply / divide


def parse_hl_smi_csv(text: str) -> list[DeviceSample]:
    """Rows of `hl-smi -Q <HL_SMI_QUERY> -f csv,noheader`, e.g. `0, 35 %, 1024 MiB, 131072 MiB, 220 W, 36 C`."""
    devices = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(HL_SMI_QUERY):
            raise ValueError(
                f"hl-smi: expected {len(HL_SMI_QUERY)} fields ({','.join(HL_SMI_QUERY)}), got {line!r}"
            )
        values = {
            name: _parse_value(cell, name) for name, cell in zip(HL_SMI_QUERY[1:], cells[1:], strict=True)
        }
        devices.append(
            DeviceSample(
                index=int(cells[0]),
                utilization_ratio=values["utilization.aip"],
                memory_used_bytes=values["memory.used"],
                memory_total_bytes=values["memory.total"],
                power_watts=values["power.draw"],
                temperature_celsius=values["temperature.aip"],
            )
        )
    return devices


def query_hl_smi(executable: str) -> list[DeviceSample]:
    """Every Gaudi of the node, through one `hl-smi` CSV query (not yet validated on Gaudi hardware)."""
    args = [executable, "-Q", ",".join(HL_SMI_QUERY), "-f", "csv,noheader"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=_HL_SMI_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()[:200]}")
    return parse_hl_smi_csv(done.stdout)


def _nvml_reading(nvml: ModuleType, function: Callable[[Any], Any], handle: Any) -> Any:
    try:
        return function(handle)
    except nvml.NVMLError_NotSupported:  # e.g. power on some boards: absent, not zero
        return None


def _nvml_gpu_temperature(nvml: ModuleType) -> Callable[[Any], Any]:
    """The GPU die sensor's reading, whole °C (NVML `nvmlDeviceGetTemperature(handle, NVML_TEMPERATURE_GPU)`)."""
    return lambda handle: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)


def query_nvml(nvml: ModuleType) -> list[DeviceSample]:
    """Every GPU NVML sees (its indices ignore CUDA_VISIBLE_DEVICES); `nvml` is the initialized pynvml module."""
    devices = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        rates = _nvml_reading(nvml, nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = _nvml_reading(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
        power_mw = _nvml_reading(nvml, nvml.nvmlDeviceGetPowerUsage, handle)
        temperature_c = _nvml_reading(nvml, _nvml_gpu_temperature(nvml), handle)
        devices.append(
            DeviceSample(
                index=index,
                utilization_ratio=None if rates is None else rates.gpu / 100,
                memory_used_bytes=None if memory is None else float(memory.used),
                memory_total_bytes=None if memory is None else float(memory.total),
                power_watts=None if power_mw is None else power_mw / 1000,
                temperature_celsius=None if temperature_c is None else float(temperature_c),
            )
        )
    return devices


class SystemSampler:
    """A daemon thread: `publish(sample)` now and every `every_s` seconds until `stop()`.

    A device source that fails (NVML error, hl-smi exit code or unexpected output) is reported once through
    `warn` and left out of later samples; host and memory readings go on.
    """

    def __init__(
        self,
        publish: Callable[[SystemSample], None],
        *,
        every_s: float,
        device: torch.device,
        node_wide: bool,
        warn: Callable[[str], None],
    ) -> None:
        self.publish = publish
        self.every_s = every_s
        self.device = device
        self.node_wide = node_wide
        self.warn = warn
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: ModuleType | None = None
        self._hl_smi: str | None = None
        if node_wide:
            psutil.cpu_percent(interval=None)  # the first call only starts the interval
            self._nvml = self._open_nvml()
            self._hl_smi = shutil.which("hl-smi")

    def _open_nvml(self) -> ModuleType | None:
        try:
            import pynvml
        except ImportError:
            if torch.cuda.is_available():
                self.warn(
                    "GPU utilization and power need NVML: pip install nvidia-ml-py (GPU metrics are off)"
                )
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            if torch.cuda.is_available():
                self.warn(f"NVML did not start ({exc}); GPU metrics are off")
            return None
        return pynvml

    def sample(self) -> SystemSample:
        allocated, peak = device_memory_bytes(self.device)
        sample = SystemSample(
            process_resident_memory_bytes=int(psutil.Process().memory_info().rss),
            device_memory_allocated_bytes=allocated,
            device_memory_peak_bytes=peak,
        )
        if self.node_wide:
            memory = psutil.virtual_memory()
            sample.host_cpu_utilization_ratio = psutil.cpu_percent(interval=None) / 100
            sample.host_memory_used_bytes = int(memory.total - memory.available)
            sample.host_memory_total_bytes = int(memory.total)
            sample.gpus = self._read_gpus()
            sample.hpus = self._read_hpus()
        return sample

    def _read_gpus(self) -> list[DeviceSample]:
        if self._nvml is None:
            return []
        try:
            return query_nvml(self._nvml)
        except self._nvml.NVMLError as exc:
            self.warn(f"NVML failed ({exc}); GPU metrics are off for the rest of the run")
            self._nvml = None
            return []

    def _read_hpus(self) -> list[DeviceSample]:
        if self._hl_smi is None:
            return []
        try:
            return query_hl_smi(self._hl_smi)
        except (OSError, subprocess.TimeoutExpired, RuntimeError, ValueError) as exc:
            self.warn(f"hl-smi failed ({exc}); Gaudi metrics are off for the rest of the run")
            self._hl_smi = None
            return []

    def start(self) -> SystemSampler:
        self.publish(self.sample())  # the first scrape already has values
        self._thread = threading.Thread(target=self._run, name="gaudi3-system-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.publish(self.sample())

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.every_s))
            self._thread = None
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None
