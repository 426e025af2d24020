"""Where two training loops' steps differ: aggregate a torch.profiler Chrome trace per step, then diff two of them.

`bench_gpu.py --profile N` records N steps of the plain loop and of `gaudi3 train` (same cell, same profiler
activities) and calls `compare` on the two traces. What a step is made of, per recorded step:

- `step_ms`: the mean `ProfilerStep#k` span (from one `profiler.step()` to the next: the whole step, data included);
- `device_busy_ms` / `device_idle_ms`: the union of device kernel and memcpy intervals inside those spans, and the
  rest of the span: time the accelerator waited for the host (launch overhead, a host sync, Python between steps);
- `host_syncs`: CUDA runtime calls that block the host until the device is done (synchronize, blocking memcpy);
- `kernels`: per device-kernel name, launches and µs per step; `ops`: per CPU operator name, calls per step.

On a CPU trace there are no kernels: the operator counts are what tell the loops apart (an op one side runs and
the other does not). The diff lists the largest per-step differences first.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["aggregate", "compare", "format_diff"]

_DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
# CUDA runtime calls after which the host has waited for the device (a blocking copy waits for the stream).
_SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy ")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _inside(ts: float, spans: list[tuple[float, float]]) -> bool:
    return any(start <= ts < stop for start, stop in spans)


def aggregate(trace_path: Path) -> dict[str, Any]:
    """Per-step figures of one Chrome trace written by torch.profiler (see the module docstring)."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in complete
             if str(e.get("name", "")).startswith("ProfilerStep#")]  # fmt: skip
    if not spans:
        raise ValueError(f"{trace_path}: no ProfilerStep# spans: was the profiler stepped once per step?")
    steps = len(spans)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    ops: dict[str, float] = defaultdict(float)
    device: list[tuple[float, float]] = []
    syncs = 0
    for e in complete:
        ts, name, cat = float(e["ts"]), str(e.get("name", "")), e.get("cat")
        if not _inside(ts, spans):
            continue
        if cat in _DEVICE_CATEGORIES:
            device.append((ts, ts + float(e["dur"])))
            kernels[name][0] += 1
            kernels[name][1] += float(e["dur"])
        elif cat == "cpu_op":
            ops[name] += 1
        elif cat == "cuda_runtime" and name.startswith(_SYNC_CALLS):
            syncs += 1
    clipped = [(max(a, s), min(b, t)) for a, b in device for s, t in spans if a < t and b > s]
    step_us = sum(t - s for s, t in spans) / steps
    busy_us = _union_us(clipped) / steps
    return {
        "steps": steps,
        "step_ms": step_us / 1e3,
        "device_busy_ms": busy_us / 1e3 if device else None,
        "device_idle_ms": (step_us - busy_us) / 1e3 if device else None,
        "host_syncs_per_step": syncs / steps,
        "kernels": {k: {"launches": n / steps, "us": us / steps} for k, (n, us) in kernels.items()},
        "ops": {k: n / steps for k, n in ops.items()},
    }


def compare(plain: dict[str, Any], ours: dict[str, Any], *, top: int = 20) -> dict[str, Any]:
    """gaudi3 − plain, per step: the largest kernel-time and operator-count differences first."""

    def delta(a: dict[str, float], b: dict[str, float]) -> list[dict[str, Any]]:
        rows = [{"name": k, "plain": a.get(k, 0.0), "gaudi3": b.get(k, 0.0), "delta": b.get(k, 0.0) - a.get(k, 0.0)}
                for k in a.keys() | b.keys()]  # fmt: skip
        rows = [r for r in rows if abs(r["delta"]) > 1e-9]
        return sorted(rows, key=lambda r: (-abs(r["delta"]), r["name"]))[:top]

    summary = {key: {"plain": plain[key], "gaudi3": ours[key]}
               for key in ("step_ms", "device_busy_ms", "device_idle_ms", "host_syncs_per_step")}  # fmt: skip
    return {
        "per_step": summary,
        "kernel_us": delta(
            {k: v["us"] for k, v in plain["kernels"].items()},
            {k: v["us"] for k, v in ours["kernels"].items()},
        ),
        "op_calls": delta(plain["ops"], ours["ops"]),
    }


def format_diff(name: str, diff: dict[str, Any], *, rows: int = 12) -> str:
    lines = [f"== {name}: per step, plain vs gaudi3"]
    for key, both in diff["per_step"].items():
        if both["plain"] is not None:
            lines.append(f"  {key:22s} {both['plain']:10.3f} {both['gaudi3']:10.3f}")
    for title, key in (("device kernel µs", "kernel_us"), ("CPU op calls", "op_calls")):
        if diff[key]:
            lines.append(f"  {title} (gaudi3 − plain), largest first:")
            lines += [f"    {r['delta']:+10.2f}  {r['name'][:90]}" for r in diff[key][:rows]]
    return "\n".join(lines)
