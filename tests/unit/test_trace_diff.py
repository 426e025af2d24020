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
    # No device work: no idle gaps to attribute, and no block about them.
    assert plain["gaps_over_100us_per_step"] is None and plain["largest_gaps"] == []
    assert plain["idle_by_op"] == plain["idle_after_sync_us"] == {}
    assert diff["idle_us_by_op"] == diff["idle_us_after_sync"] == []
    text = trace_diff.format_diff("cell", diff)
    assert "aten::item" in text and "idle" not in text and "gap" not in text


_HOST, _BACKWARD, _STREAM = (1, 1), (1, 2), (0, 7)  # (pid, tid) as torch.profiler writes them


def _event(
    name: str, cat: str, ts: float, dur: float, *, thread: tuple[int, int] | None = None, **args: Any
) -> dict[str, Any]:
    pid, tid = thread or (_STREAM if cat in ("kernel", "gpu_memcpy") else _HOST)
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def _flow(phase: str, flow_id: int, ts: float, thread: tuple[int, int]) -> dict[str, Any]:
    """One end of the "ac2g" arrow from a launch call (phase "s") to its kernel (phase "f")."""
    pid, tid = thread
    return {"ph": phase, "id": flow_id, "pid": pid, "tid": tid, "ts": ts, "cat": "ac2g", "name": "ac2g"}


def test_device_busy_idle_and_host_syncs_come_from_kernel_intervals_inside_the_steps(tmp_path: Path) -> None:
    # Two 10 ms steps as a CUDA trace would record them: overlapping kernels count once, a kernel running past the
    # step's end counts whole in its step (whose device window ends with it), and kernels outside every step
    # (profiler warm-up) do not count. No launch links here: each device event belongs to the span it starts in.
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
    assert agg["device_busy_ms"] == pytest.approx((6_000 + 1_000 + 4_000) / 2 / 1e3)
    # device windows [0, 10000) and [10000, 22000): 22 ms over 2 steps, 11 ms of it busy
    assert agg["device_idle_ms"] == pytest.approx((22.0 - 11.0) / 2)
    assert agg["host_syncs_per_step"] == pytest.approx(0.5)
    assert agg["kernels"]["gemm"] == {"launches": 1.5, "us": 6_000.0}
    assert agg["ops"] == {"aten::mm": 0.5}
    # No correlation ids nor flow arrows: every gap is still counted, under one honest key.
    assert agg["idle_by_op"] == {"(no linked launch)": {"us": 5_500.0, "gaps": 2.0, "python_function": None}}
    assert agg["idle_after_sync_us"] == {"cudaStreamSynchronize": 3_000.0}  # overlaps the 12000..18000 gap
    assert agg["gaps_over_100us_per_step"] == 2.0

    (tmp_path / "empty.json").write_text(json.dumps({"traceEvents": events[2:]}))
    with pytest.raises(ValueError, match="no ProfilerStep# spans"):
        trace_diff.aggregate(tmp_path / "empty.json")


def _linked_trace(path: Path, *, with_sync: bool, with_orphan: bool) -> Path:
    """Two 10 ms steps whose idle gaps (µs) end with known launches:

    step 1: [0, 500) aten::mm │ [2500, 2700) aten::addmm │ [3000, 3050) and, after the sync, [3060, 7200)
            .item()'s copy then aten::zero_ (flow arrow only) │ [7300, 10000) step 2's first copy
    step 2: [10000, 10500) aten::copy_ │ [10600, 11000) aten::mm on the backward thread │ [19000, 19200)
            Optimizer.step, a record_function scope │ [19300, 19500) a kernel whose launch is not in the trace │
            [19600 or 19300, 20000) no later kernel
    """
    events = [
        _event("ProfilerStep#1", "user_annotation", 0, 10_000),
        _event("ProfilerStep#2", "user_annotation", 10_000, 10_000),
        _event("model.py(5): forward", "python_function", 50, 2_950),
        _event("<built-in method mm of type object>", "python_function", 100, 300),
        _event("aten::mm", "cpu_op", 100, 300),
        _event("cudaLaunchKernel", "cuda_runtime", 150, 10, correlation=1),
        _event("gemm", "kernel", 500, 2_000, correlation=1),
        _event("aten::linear", "cpu_op", 2_550, 250),
        _event(
            "aten::addmm", "cpu_op", 2_600, 100
        ),  # innermost: the gap is charged here, not to aten::linear
        _event("cudaLaunchKernel", "cuda_runtime", 2_610, 10, correlation=2),
        _event("addmm", "kernel", 2_700, 300, correlation=2),
        _event("aten::item", "cpu_op", 2_990, 3_010),
        _event("aten::_local_scalar_dense", "cpu_op", 3_000, 3_000),
        _event("cudaMemcpyAsync", "cuda_runtime", 3_010, 10, correlation=3),  # not a sync
        _event("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", 3_050, 10, correlation=3),
        _event(
            "Optimizer.zero_grad#AdamW.zero_grad", "user_annotation", 6_900, 250
        ),  # the cpu_op inside wins
        _event("aten::zero_", "cpu_op", 7_000, 100),
        _event("cuLaunchKernel", "cuda_driver", 7_010, 10),  # linked by the flow arrow only
        _flow("s", 4, 7_010, _HOST),
        _flow("f", 4, 7_200, _STREAM),
        _event("fill", "kernel", 7_200, 100),
        _event("aten::copy_", "cpu_op", 10_100, 100),
        _event("cudaMemcpyAsync", "cuda_runtime", 10_110, 10, correlation=5),
        _event("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 10_500, 100, correlation=5),
        _event("aten::sum", "cpu_op", 10_600, 200),  # running on the main thread meanwhile: not the launcher
        _event("aten::mm", "cpu_op", 10_600, 100, thread=_BACKWARD),
        _event("cudaLaunchKernel", "cuda_runtime", 10_650, 10, thread=_BACKWARD, correlation=6),
        _event("gemm", "kernel", 11_000, 8_000, correlation=6),
        _event("Optimizer.step#AdamW.step", "user_annotation", 19_050, 100),  # no cpu_op around this launch
        _event("cudaLaunchKernel", "cuda_runtime", 19_100, 10, correlation=7),
        _event("multi_tensor_apply_kernel", "kernel", 19_200, 100, correlation=7),
    ]
    if with_sync:
        events.append(_event("cudaStreamSynchronize", "cuda_runtime", 3_020, 60))
    if with_orphan:
        events.append(_event("orphan", "kernel", 19_500, 100, correlation=99))
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_idle_gaps_are_charged_to_the_op_launching_the_next_kernel_and_to_the_sync_before(
    tmp_path: Path,
) -> None:
    agg = trace_diff.aggregate(_linked_trace(tmp_path / "ours.json", with_sync=True, with_orphan=True))
    us = {op: row["us"] for op, row in agg["idle_by_op"].items()}
    assert us == {
        "aten::mm": (500 + 400) / 2,
        "aten::addmm": 200 / 2,
        "aten::_local_scalar_dense": 50 / 2,
        "aten::zero_": (7_200 - 3_060) / 2,
        "aten::copy_": (2_700 + 500) / 2,  # step 1's last gap ends with step 2's first copy
        "Optimizer.step#AdamW.step": 200 / 2,
        "(no linked launch)": 200 / 2,
        "(no later kernel)": 400 / 2,
    }
    assert sum(us.values()) == pytest.approx(agg["device_idle_ms"] * 1e3)  # every idle µs is charged once
    assert agg["idle_by_op"]["aten::mm"]["gaps"] == 1.0
    assert agg["idle_by_op"]["aten::mm"]["python_function"] == "model.py(5): forward"  # not the built-in call
    assert agg["idle_by_op"]["aten::zero_"]["python_function"] is None
    assert agg["idle_after_sync_us"] == {"cudaStreamSynchronize": (50 + 4_140) / 2}
    assert agg["host_syncs_per_step"] == 0.5 and agg["gaps_over_100us_per_step"] == 4.5
    largest = agg["largest_gaps"][0]
    assert largest == {"step": "ProfilerStep#1", "start_us": 3_060.0, "us": 4_140.0, "op": "aten::zero_",
                       "python_function": None, "sync": "cudaStreamSynchronize"}  # fmt: skip
    assert [g["us"] for g in agg["largest_gaps"]] == [4_140.0, 2_700.0, 500.0, 500.0, 400.0]

    plain = trace_diff.aggregate(_linked_trace(tmp_path / "plain.json", with_sync=False, with_orphan=False))
    diff = trace_diff.compare(plain, agg)
    by_op = {r["name"]: r["delta"] for r in diff["idle_us_by_op"]}
    assert by_op == {"(no linked launch)": 100.0, "(no later kernel)": 200.0 - 350.0}
    assert diff["idle_us_after_sync"] == [
        {"name": "cudaStreamSynchronize", "plain": 0.0, "gaudi3": 2_095.0, "delta": 2_095.0}
    ]
    assert diff["per_step"]["gaps_over_100us_per_step"] == {"plain": 4.0, "gaudi3": 4.5}
    text = trace_diff.format_diff("cell", diff)
    idle_block = text[text.index("device idle µs per step by") :].splitlines()
    assert len(idle_block) <= 12
    assert (
        "4140.0 µs at +3060.0 µs into ProfilerStep#1, ended by aten::zero_, after cudaStreamSynchronize"
        in text
    )


def _stepped_trace(path: Path, *, step_us: float, lag_us: float) -> Path:
    """Three steps of one 900 µs gemm each, launched 15 µs into its host step and starting `lag_us` later, plus
    the gemm of the step before the window (launched before it, still running when it starts, as on CUDA).

    lag 50 with 1000 µs steps: a loop that waits for the device every step; lag 1000 with 950 µs steps: a loop
    whose host runs a step ahead, so each gemm starts after its own host step ended."""
    events = [_event("cudaLaunchKernel", "cuda_runtime", 15 - step_us, 5, correlation=100),
              _event("gemm", "kernel", 15 - step_us + lag_us, 900, correlation=100)]  # fmt: skip
    for k in range(3):
        start = k * step_us
        events += [
            _event(f"ProfilerStep#{k + 5}", "user_annotation", start, step_us),
            _event("aten::mm", "cpu_op", start + 10, 20),
            _event("cudaLaunchKernel", "cuda_runtime", start + 15, 5, correlation=k),
            _event("gemm", "kernel", start + 15 + lag_us, 900, correlation=k),
        ]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_a_kernel_counts_in_the_step_that_launched_it_even_when_it_runs_after_that_step(
    tmp_path: Path,
) -> None:
    synced = trace_diff.aggregate(_stepped_trace(tmp_path / "synced.json", step_us=1_000, lag_us=50))
    ahead = trace_diff.aggregate(_stepped_trace(tmp_path / "ahead.json", step_us=950, lag_us=1_000))
    # The same device work per step on both sides: every step's gemm, none dropped or charged to the next step.
    assert synced["kernels"] == ahead["kernels"] == {"gemm": {"launches": 1.0, "us": 900.0}}
    assert synced["device_busy_ms"] == ahead["device_busy_ms"] == pytest.approx(0.9)
    # Synced: the device waits 65 µs for each launch and 35 µs at each step's end. Ahead: the device runs its
    # gemms 50 µs apart (launch lag behind the previous one): the loop that pipelines idles less, not more.
    assert synced["device_idle_ms"] == pytest.approx(0.1)
    assert ahead["device_idle_ms"] == pytest.approx(0.05)
    assert max(g["us"] for g in ahead["largest_gaps"]) == pytest.approx(50.0)
    diff = trace_diff.compare(synced, ahead)
    assert diff["kernel_us"] == []  # no kernel-time difference to report: there is none


def _one_step_trace(path: Path, *, with_kernel: bool) -> Path:
    events = [_event("ProfilerStep#3", "user_annotation", 0, 1_000), _event("aten::mm", "cpu_op", 10, 20)]
    if with_kernel:  # the other side: no device activity (CUPTI not attached, or profiled without "cuda")
        events.append(_event("gemm", "kernel", 40, 500))
    path.write_text(json.dumps({"traceEvents": events}))
    return path


@pytest.mark.parametrize("device_side", ["plain", "gaudi3"])
def test_a_diff_where_only_one_side_has_device_work_prints_a_dash_for_the_other(
    tmp_path: Path, device_side: str
) -> None:
    with_device = trace_diff.aggregate(_one_step_trace(tmp_path / "device.json", with_kernel=True))
    without = trace_diff.aggregate(_one_step_trace(tmp_path / "host.json", with_kernel=False))
    plain, ours = (with_device, without) if device_side == "plain" else (without, with_device)
    text = trace_diff.format_diff("cell", trace_diff.compare(plain, ours))
    busy = next(line.split() for line in text.splitlines() if "device_busy_ms" in line)
    assert (
        busy == ["device_busy_ms", "0.500", "–"]
        if device_side == "plain"
        else ["device_busy_ms", "–", "0.500"]
    )
    assert "-500.00  gemm" in text if device_side == "plain" else "+500.00  gemm" in text
