"""benchmarks/trace_diff.py: per-step figures of a profiler trace, and the diff of two (`bench_gpu.py --profile`)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gaudi3_scale.monitor.profiler import GaudiProfiler

_SPEC = importlib.util.spec_from_file_location(
    "trace_diff", Path(__file__).resolve().parents[2] / "benchmarks" / "trace_diff.py"
)
assert _SPEC and _SPEC.loader
trace_diff = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(trace_diff)


def _profiled_loop(path: Path, *, extra_item: bool) -> Path:
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GaudiProfiler(["cpu"], schedule_wait=0, schedule_warmup=1, schedule_active=4) as prof:
        for _ in range(6):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if extra_item:
                loss.item()  # what a per-step host sync looks like in a loop
            prof.step()
    return prof.export_chrome_trace(path)


def test_a_real_trace_diff_names_the_op_only_one_loop_runs(tmp_path: Path) -> None:
    plain = trace_diff.aggregate(_profiled_loop(tmp_path / "plain.json", extra_item=False))
    ours = trace_diff.aggregate(_profiled_loop(tmp_path / "ours.json", extra_item=True))
    assert plain["steps"] == ours["steps"] == 4
    assert plain["ops"]["aten::mm"] == ours["ops"]["aten::mm"] >= 1  # the same math on both sides
    assert plain["device_busy_ms"] is None and plain["step_ms"] > 0  # a CPU trace has no device kernels
    diff = trace_diff.compare(plain, ours)
    deltas = {row["name"]: row["delta"] for row in diff["op_calls"]}
    assert deltas["aten::item"] == pytest.approx(1.0) and deltas[
        "aten::_local_scalar_dense"
    ] == pytest.approx(1.0)
    assert "aten::mm" not in deltas and diff["kernel_us"] == []
    assert "aten::item" in trace_diff.format_diff("cell", diff)


def _event(name: str, cat: str, ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_device_busy_idle_and_host_syncs_come_from_kernel_intervals_inside_the_steps(tmp_path: Path) -> None:
    # Two 10 ms steps as a CUDA trace would record them: overlapping kernels count once, a kernel running past the
    # step's end counts only inside it, and kernels outside every step (profiler warm-up) do not count.
    events = [
        _event("ProfilerStep#5", "user_annotation", 0, 10_000),
        _event("ProfilerStep#6", "user_annotation", 10_000, 10_000),
        _event("gemm", "kernel", 1_000, 4_000),
        _event("gemm", "kernel", 3_000, 4_000),  # overlaps the first: busy 1000..7000
        _event("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 11_000, 1_000),
        _event("gemm", "kernel", 18_000, 4_000),  # busy 18000..20000 inside step 6
        _event("gemm", "kernel", 25_000, 1_000),  # after the window
        _event("cudaStreamSynchronize", "cuda_runtime", 12_500, 3_000),
        _event("cudaLaunchKernel", "cuda_runtime", 900, 5),
        _event("aten::mm", "cpu_op", 800, 100),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    agg = trace_diff.aggregate(path)
    assert agg["steps"] == 2 and agg["step_ms"] == pytest.approx(10.0)
    assert agg["device_busy_ms"] == pytest.approx((6_000 + 1_000 + 2_000) / 2 / 1e3)
    assert agg["device_idle_ms"] == pytest.approx(10.0 - 4.5)
    assert agg["host_syncs_per_step"] == pytest.approx(0.5)
    assert agg["kernels"]["gemm"] == {"launches": 1.5, "us": 6_000.0}
    assert agg["ops"] == {"aten::mm": 0.5}

    (tmp_path / "empty.json").write_text(json.dumps({"traceEvents": events[2:]}))
    with pytest.raises(ValueError, match="no ProfilerStep# spans"):
        trace_diff.aggregate(tmp_path / "empty.json")
