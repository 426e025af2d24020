"""Where two training loops' steps differ: aggregate a torch.profiler Chrome trace per step, then diff two of them.

`bench_gpu.py --profile N` records N steps of the plain loop and of `gaudi3 train` (same cell, same profiler
activities) and calls `compare` on the two traces. What a step is made of, per recorded step:

- `step_ms`: the mean `ProfilerStep#k` span (from one `profiler.step()` to the next: the whole step, data included);
- `device_busy_ms` / `device_idle_ms`: on the device's own timeline, the union of the kernel and memcpy intervals
  each step launched, and the rest of the step's device window: time the accelerator waited for the host (launch
  overhead, a host sync, Python between steps). A device event belongs to the step whose host span contains its
  launch call (the `correlation` id or flow arrow, below), not to the span its own start falls in: on CUDA the host
  runs ahead of the device, so a step's kernels often run after its host span ended, and attributing them by start
  time would drop the last step's work and charge each step's to the next. A step's device window runs from the
  end of the earlier steps' device work to the later of its host span's end and the end of its own work, so these
  two add up to the device time per step, which can differ from `step_ms` (the host's);
- `host_syncs_per_step`: CUDA runtime/driver calls that block the host until the device is done (synchronize,
  blocking memcpy);
- `kernels`: per device-kernel name, launches and µs per step; `ops`: per CPU operator name, calls per step.

Where the idle time goes: each idle gap of a step (before its first device interval, between two, after its last)
ends when the host launches the next kernel, so the gap is charged to the innermost CPU operator around that
launch (else the innermost `record_function` scope, such as `Optimizer.step#AdamW.step`), with the Python function
around it when the trace has stacks (`idle_by_op`). The kernel → launch link is the `correlation` argument shared
by a kernel and its `cuda_runtime` / `cuda_driver` launch call, else the "ac2g" flow arrow between them; a kernel
with neither is `(no linked launch)`, a gap after the trace's last kernel `(no later kernel)`. A gap that a blocking host sync overlaps is also charged to that sync (`idle_after_sync_us`):
the sync drained the device and the host had nothing queued behind it, the classic bubble. `largest_gaps` lists the
longest gaps with their start relative to their step's device window.

On a CPU trace there are no kernels: the device figures are None or empty, and the operator counts are what tell
the loops apart (an op one side runs and the other does not). The diff lists the largest per-step differences first.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["aggregate", "compare", "format_diff"]

_DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
_HOST_API_CATEGORIES = {"cuda_runtime", "cuda_driver"}
# Calls after which the host has waited for the device (a blocking cudaMemcpy waits for the stream; the async one
# and cudaMemcpyAsync do not).
_SYNC_CALLS = {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
               "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize"}  # fmt: skip
_LONG_GAP_US = 100.0
_LARGEST_GAPS = 5
_NO_LAUNCH, _NO_LATER_KERNEL, _NO_OP = "(no linked launch)", "(no later kernel)", "(launch outside any op)"

Interval = tuple[float, float]


def _merged(intervals: list[Interval]) -> list[Interval]:
    """The union of intervals as sorted, disjoint intervals."""
    out: list[Interval] = []
    for start, stop in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _gaps(span: Interval, busy: list[Interval]) -> list[Interval]:
    """The parts of `span` outside the sorted, disjoint `busy` intervals (all inside it)."""
    edges = [span[0], *(t for interval in busy for t in interval), span[1]]
    return [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if b > a]


def _innermost(events: list[dict[str, Any]], queries: list[tuple[Any, float]]) -> list[str | None]:
    """Per (thread, ts) query: the name of the innermost event of `events` on that thread that contains ts."""
    by_thread: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        ts = float(e["ts"])
        by_thread[(e.get("pid"), e.get("tid"))].append((ts, ts + float(e["dur"]), str(e.get("name", ""))))
    asked: dict[Any, list[tuple[float, int]]] = defaultdict(list)
    for i, (thread, ts) in enumerate(queries):
        asked[thread].append((ts, i))
    out: list[str | None] = [None] * len(queries)
    for thread, points in asked.items():
        spans = sorted(by_thread.get(thread, []), key=lambda s: (s[0], -s[1]))  # outer before inner
        stack: list[tuple[float, float, str]] = []
        nxt = 0
        for ts, i in sorted(points):
            while nxt < len(spans) and spans[nxt][0] <= ts:
                while stack and stack[-1][1] <= spans[nxt][0]:
                    stack.pop()
                stack.append(spans[nxt])
                nxt += 1
            while stack and stack[-1][1] <= ts:
                stack.pop()
            out[i] = stack[-1][2] if stack else None
    return out


def _launch_sites(
    events: list[dict[str, Any]], device: list[dict[str, Any]]
) -> list[tuple[Any, float] | None]:
    """Per device event: the (thread, ts) of the host call that launched it, or None where the trace has no link."""
    by_corr: dict[Any, tuple[Any, float]] = {}
    flow_end: dict[tuple[Any, Any, float], Any] = {}
    for e in events:
        if e.get("cat") == "ac2g" and e.get("ph") == "s":
            by_corr.setdefault(e.get("id"), ((e.get("pid"), e.get("tid")), float(e["ts"])))
        elif e.get("cat") == "ac2g" and e.get("ph") == "f":
            flow_end[(e.get("pid"), e.get("tid"), float(e["ts"]))] = e.get("id")
    for e in events:  # the launch call itself, where the trace has it, over the flow arrow's start
        corr = (e.get("args") or {}).get("correlation")
        if e.get("ph") == "X" and e.get("cat") in _HOST_API_CATEGORIES and corr is not None:
            by_corr[corr] = ((e.get("pid"), e.get("tid")), float(e["ts"]))
    sites = []
    for k in device:
        corr = (k.get("args") or {}).get("correlation")
        corr = flow_end.get((k.get("pid"), k.get("tid"), float(k["ts"]))) if corr is None else corr
        sites.append(by_corr.get(corr))
    return sites


def _idle_gaps(
    events: list[dict[str, Any]],
    complete: list[dict[str, Any]],
    steps: list[tuple[str, Interval, list[Interval]]],
) -> list[dict[str, Any]]:
    """Every device-idle gap of the (step name, span, busy intervals) steps, with what the host did about it;
    `complete` are the trace's complete ("X") events among `events`."""
    device = sorted((e for e in complete if e.get("cat") in _DEVICE_CATEGORIES), key=lambda e: float(e["ts"]))
    starts = [float(e["ts"]) for e in device]
    gaps = [(name, span, gap) for name, span, busy in steps for gap in _gaps(span, busy)]
    # The gap ends when the next device work starts (for a step's last gap: the next step's first kernel).
    ending = [bisect.bisect_left(starts, gap[1]) for _, _, gap in gaps]
    sites = _launch_sites(events, [device[i] for i in ending if i < len(device)])
    site_of = dict(zip([i for i in ending if i < len(device)], sites, strict=True))
    queries = [site for site in sites if site is not None]
    ops = dict(
        zip(queries, _innermost([e for e in complete if e.get("cat") == "cpu_op"], queries), strict=True)
    )
    annotations = [e for e in complete if e.get("cat") == "user_annotation"
                   and not str(e.get("name", "")).startswith("ProfilerStep#")]  # fmt: skip
    scopes = dict(zip(queries, _innermost(annotations, queries), strict=True))
    python = [e for e in complete if e.get("cat") == "python_function"
              and not str(e.get("name", "")).startswith("<built-in")]  # fmt: skip  # the C call, not the Python line
    functions = dict(zip(queries, _innermost(python, queries), strict=True))
    syncs = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e["name"])) for e in complete
                   if e.get("cat") in _HOST_API_CATEGORIES and e.get("name") in _SYNC_CALLS)  # fmt: skip
    out = []
    for (name, span, (start, stop)), i in zip(gaps, ending, strict=True):
        site = site_of.get(i)
        if i >= len(device):
            op = _NO_LATER_KERNEL
        elif site is None:
            op = _NO_LAUNCH
        else:
            op = ops[site] or scopes[site] or _NO_OP
        overlapping = [s for s in syncs if s[0] < stop and s[1] > start]
        out.append({"step": name, "start_us": start - span[0], "us": stop - start, "op": op,
                    "python_function": functions.get(site) if site else None,
                    "sync": overlapping[-1][2] if overlapping else None})  # fmt: skip
    return out


def _idle_summary(gaps: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per step: idle µs by launching op and by overlapping sync, long gaps, and the largest gaps."""
    by_op: dict[str, dict[str, Any]] = {}
    functions: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    after_sync: dict[str, float] = defaultdict(float)
    for gap in gaps:
        row = by_op.setdefault(gap["op"], {"us": 0.0, "gaps": 0.0, "python_function": None})
        row["us"] += gap["us"] / steps
        row["gaps"] += 1 / steps
        if gap["python_function"]:
            functions[gap["op"]][gap["python_function"]] += gap["us"]
        if gap["sync"]:
            after_sync[gap["sync"]] += gap["us"] / steps
    for op, us_by_function in functions.items():  # the function behind most of the op's idle time
        by_op[op]["python_function"] = max(us_by_function, key=lambda f: (us_by_function[f], f))
    return {
        "idle_by_op": by_op,
        "idle_after_sync_us": dict(after_sync),
        "gaps_over_100us_per_step": sum(g["us"] > _LONG_GAP_US for g in gaps) / steps,
        "largest_gaps": sorted(gaps, key=lambda g: -g["us"])[:_LARGEST_GAPS],
    }


def _step_of(spans: list[tuple[str, Interval]], ts: float) -> int | None:
    """The index of the span (sorted, disjoint) that contains `ts`, else None."""
    i = bisect.bisect_right([start for _, (start, _) in spans], ts) - 1
    return i if i >= 0 and ts < spans[i][1][1] else None


def _device_steps(
    events: list[dict[str, Any]], complete: list[dict[str, Any]], spans: list[tuple[str, Interval]]
) -> tuple[list[list[dict[str, Any]]], list[Interval]]:
    """Per step: the device events it launched, and the step's window on the device's own timeline.

    A device event belongs to the step whose host span contains its launch call (linked by correlation id or flow
    arrow), not to the span its own start falls in: on CUDA the host runs ahead, so a step's kernels often run
    after its host span ended. An event with no linked launch falls back to its own start. Step k's device window
    runs from the end of the earlier steps' device work (the first step's: of the work launched before the
    window) to the later of its host span's end and the end of its own device work, so the windows tile the
    device's timeline and idle time is what the device really waited, not an artefact of host lead."""
    device = [e for e in complete if e.get("cat") in _DEVICE_CATEGORIES]
    launched = [
        site[1] if site else float(e["ts"])
        for e, site in zip(device, _launch_sites(events, device), strict=True)
    ]
    per_step: list[list[dict[str, Any]]] = [[] for _ in spans]
    before = spans[0][1][0]  # device work launched before the first step ends here at the latest
    for e, ts in zip(device, launched, strict=True):
        step = _step_of(spans, ts)
        if step is not None:
            per_step[step].append(e)
        elif ts < spans[0][1][0]:
            before = max(before, float(e["ts"]) + float(e["dur"]))
    windows: list[Interval] = []
    start = before
    for (_, (_, host_stop)), events_of_step in zip(spans, per_step, strict=True):
        stop = max([host_stop, start, *(float(e["ts"]) + float(e["dur"]) for e in events_of_step)])
        windows.append((start, stop))
        start = stop
    return per_step, windows


def aggregate(trace_path: Path) -> dict[str, Any]:
    """Per-step figures of one Chrome trace written by torch.profiler (see the module docstring)."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    spans = sorted(
        ((str(e["name"]), (float(e["ts"]), float(e["ts"]) + float(e["dur"]))) for e in complete
         if str(e.get("name", "")).startswith("ProfilerStep#")),
        key=lambda span: span[1],
    )  # fmt: skip
    if not spans:
        raise ValueError(f"{trace_path}: no ProfilerStep# spans: was the profiler stepped once per step?")
    steps = len(spans)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    ops: dict[str, float] = defaultdict(float)
    syncs = 0
    for e in complete:  # host events: by their own start
        name, cat = str(e.get("name", "")), e.get("cat")
        if _step_of(spans, float(e["ts"])) is None:
            continue
        if cat == "cpu_op":
            ops[name] += 1
        elif cat in _HOST_API_CATEGORIES and name in _SYNC_CALLS:
            syncs += 1
    per_step, windows = _device_steps(events, complete, spans)
    busy = []
    for (name, _), window, device_events in zip(spans, windows, per_step, strict=True):
        for e in device_events:
            kernels[str(e.get("name", ""))][0] += 1
            kernels[str(e.get("name", ""))][1] += float(e["dur"])
        # Clipped to the window only where two steps' work overlaps on the device (several streams).
        intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device_events]
        clipped = [
            (max(a, window[0]), min(b, window[1])) for a, b in intervals if b > window[0] and a < window[1]
        ]
        busy.append((name, window, _merged(clipped)))
    device = any(per_step)
    step_us = sum(t - s for _, (s, t) in spans) / steps
    window_us = sum(t - s for s, t in windows) / steps
    busy_us = sum(b - a for _, _, intervals in busy for a, b in intervals) / steps
    idle = _idle_summary(_idle_gaps(events, complete, busy), steps) if device else {}
    return {
        "steps": steps,
        "step_ms": step_us / 1e3,
        "device_busy_ms": busy_us / 1e3 if device else None,
        "device_idle_ms": (window_us - busy_us) / 1e3 if device else None,
        "host_syncs_per_step": syncs / steps,
        "gaps_over_100us_per_step": idle.get("gaps_over_100us_per_step"),
        "kernels": {k: {"launches": n / steps, "us": us / steps} for k, (n, us) in kernels.items()},
        "ops": {k: n / steps for k, n in ops.items()},
        "idle_by_op": idle.get("idle_by_op", {}),
        "idle_after_sync_us": idle.get("idle_after_sync_us", {}),
        "largest_gaps": idle.get("largest_gaps", []),
    }


def compare(plain: dict[str, Any], ours: dict[str, Any], *, top: int = 20) -> dict[str, Any]:
    """gaudi3 − plain, per step: the largest kernel-time, operator-count and idle-time differences first."""

    def delta(a: dict[str, float], b: dict[str, float]) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = [
            {
                "name": k,
                "plain": a.get(k, 0.0),
                "gaudi3": b.get(k, 0.0),
                "delta": b.get(k, 0.0) - a.get(k, 0.0),
            }
            for k in a.keys() | b.keys()
        ]
        rows = [r for r in rows if abs(r["delta"]) > 1e-9]
        return sorted(rows, key=lambda r: (-abs(r["delta"]), r["name"]))[:top]

    keys = ("step_ms", "device_busy_ms", "device_idle_ms", "host_syncs_per_step", "gaps_over_100us_per_step")
    return {
        "per_step": {key: {"plain": plain[key], "gaudi3": ours[key]} for key in keys},
        "kernel_us": delta(
            {k: v["us"] for k, v in plain["kernels"].items()},
            {k: v["us"] for k, v in ours["kernels"].items()},
        ),
        "op_calls": delta(plain["ops"], ours["ops"]),
        "idle_us_by_op": delta(
            {k: v["us"] for k, v in plain["idle_by_op"].items()},
            {k: v["us"] for k, v in ours["idle_by_op"].items()},
        ),
        "idle_us_after_sync": delta(plain["idle_after_sync_us"], ours["idle_after_sync_us"]),
        "largest_gaps": {"plain": plain["largest_gaps"], "gaudi3": ours["largest_gaps"]},
    }


def _format_idle(diff: dict[str, Any], rows: int) -> list[str]:
    """At most 2 + `rows` + 1 + 2 + 2 lines: where each side's device idle time goes."""
    lines = []
    if diff["idle_us_by_op"]:
        lines.append(
            "  device idle µs per step by the op launching the next kernel (gaudi3 − plain, plain, gaudi3):"
        )
        lines += [f"    {r['delta']:+10.1f} {r['plain']:10.1f} {r['gaudi3']:10.1f}  {r['name'][:70]}"
                  for r in diff["idle_us_by_op"][:rows]]  # fmt: skip
    if diff["idle_us_after_sync"]:
        lines.append("  device idle µs per step in gaps a blocking host sync overlaps:")
        lines += [f"    {r['delta']:+10.1f} {r['plain']:10.1f} {r['gaudi3']:10.1f}  {r['name']}"
                  for r in diff["idle_us_after_sync"][:2]]  # fmt: skip
    largest = {side: gaps[0] for side, gaps in diff["largest_gaps"].items() if gaps}
    if largest:
        lines.append("  largest device-idle gap:")
    for side, gap in largest.items():
        sync = f", after {gap['sync']}" if gap["sync"] else ""
        lines.append(f"    {side:6s} {gap['us']:10.1f} µs at +{gap['start_us']:.1f} µs into {gap['step']}, "
                     f"ended by {gap['op'][:50]}{sync}")  # fmt: skip
    return lines


def format_diff(name: str, diff: dict[str, Any], *, rows: int = 12, idle_rows: int = 5) -> str:
    lines = [f"== {name}: per step, plain vs gaudi3"]
    for key, both in diff["per_step"].items():  # None: that side's trace has no device work ("–")
        if both["plain"] is not None or both["gaudi3"] is not None:
            plain, ours = (f"{both[side]:10.3f}" if both[side] is not None else f"{'–':>10s}"
                           for side in ("plain", "gaudi3"))  # fmt: skip
            lines.append(f"  {key:24s} {plain} {ours}")
    for title, key in (("device kernel µs", "kernel_us"), ("CPU op calls", "op_calls")):
        if diff[key]:
            lines.append(f"  {title} (gaudi3 − plain), largest first:")
            lines += [f"    {r['delta']:+10.2f}  {r['name'][:90]}" for r in diff[key][:rows]]
    return "\n".join(lines + _format_idle(diff, idle_rows))
