"""Benchmark results: computed from per-step metrics, validated by the schema, printed and collected from logs."""

from __future__ import annotations

import copy
import io
import json
import random
import statistics
from pathlib import Path
from typing import Any

import pytest

from gaudi3_scale.bench.cell import cell_of_config
from gaudi3_scale.bench.collect import collect_from_lines, collect_logs
from gaudi3_scale.bench.result import (
    CHUNK_CHARS,
    cell_section,
    failed_result,
    print_result,
    result_from_metrics,
    write_result,
)
from gaudi3_scale.bench.schema import load_result, validate_result
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.distributed.plan import BatchPlan
from gaudi3_scale.monitor.perf import mfu_above_peak
from gaudi3_scale.train.config import build_run_config

ENV = {"cpu": "test cpu", "packages": {"torch": "2.13.0"}, "git_commit": "abc"}


def _cell(world: int = 2, cell_id: str = "m.ddp.w2.mb4.32-true") -> dict[str, Any]:
    return cell_section(cell_id=cell_id, matrix="t", model="shakespeare-char", strategy="ddp", world_size=world,
                        nnodes=1, batch=BatchPlan.from_micro_batch(4, data_parallel_size=world, context_length=64),
                        precision="32-true", data="tinyshakespeare")  # fmt: skip


def _records(times: list[float], world: int = 2) -> list[dict[str, Any]]:
    out = []
    for step, t in enumerate(times, 1):
        out.append({"step": step, "train_loss": 5.0 - step * 0.1, "step_time_s": t, "tokens_per_s": 512 / t,
                    "mfu": 0.001 * (512 / t) / 1000, "peak_memory_bytes_per_rank": [100 + step, 200 - step][:world]})  # fmt: skip
    out.insert(3, {"step": 3, "val_loss": 4.0})  # validation records have no train loss: ignored
    return out


def test_result_from_metrics_by_hand() -> None:
    times = [9.0, 8.0, 0.1, 0.2, 0.3, 0.4, 0.5]  # the first two are warm-up
    result = result_from_metrics(_cell(), _records(times), warmup_steps=2, h2d_gbps=None, environment=ENV)
    validate_result(result, "test")
    m = result["metrics"]
    measured = [0.1, 0.2, 0.3, 0.4, 0.5]
    assert m["step_time_s"]["mean"] == pytest.approx(statistics.fmean(measured))
    assert m["step_time_s"]["p50"] == pytest.approx(0.3)
    assert m["step_time_s"]["p95"] == pytest.approx(0.4 + 0.8 * 0.1)  # numpy's linear interpolation
    assert m["step_time_s"]["n"] == 5
    assert m["tokens_per_s"] == pytest.approx(8 * 64 / 0.3)  # global batch 8 × 64 tokens / mean step
    assert m["samples_per_s"] == pytest.approx(8 / 0.3)
    assert m["peak_memory_bytes_per_rank"] == [107, 199]  # the largest of each rank over all steps
    assert m["peak_memory_bytes"] == 199
    assert m["mean_loss"] == pytest.approx(statistics.fmean(5.0 - s * 0.1 for s in range(3, 8)))
    assert m["mfu"] == pytest.approx(1e-6 * m["tokens_per_s"])  # per-step mfu scaled to the cell's tokens/s
    assert m["scaling_efficiency"] is None and result["steps"] == {"warmup": 2, "measured": 5}


def test_a_tensor_parallel_cell_counts_every_rank() -> None:
    # 4 ranks in tensor-parallel pairs: 2 data-parallel ranks read micro-batches of 2, twice per step of 8. The cell
    # is run on all 4 (one peak per rank), while its accumulation is over the 2 that read different data.
    cfg = build_run_config(None, [("model.name", "llama-tiny"), ("parallel.tp_size", "2"),
                                  ("parallel.nproc_per_node", "4"), ("train.global_batch_size", "8"),
                                  ("train.micro_batch_size", "2")])  # fmt: skip
    cell = cell_of_config(cfg, precision="32-true")
    assert (cell["world_size"], cell["micro_batch_size"], cell["accumulation"]) == (4, 2, 2)
    records = [{"step": step, "train_loss": 4.0, "step_time_s": 0.5, "peak_memory_bytes_per_rank": [10, 11, 12, 13]}
               for step in (1, 2, 3)]  # fmt: skip
    result = result_from_metrics(cell, records, warmup_steps=1, h2d_gbps=None, environment=ENV)
    validate_result(result, "test")
    assert result["metrics"]["peak_memory_bytes_per_rank"] == [10, 11, 12, 13]
    assert result["metrics"]["tokens_per_s"] == 8 * cfg.model.context_length / 0.5


def test_no_measured_steps_is_a_failed_result() -> None:
    result = result_from_metrics(
        _cell(), _records([1.0, 1.0]), warmup_steps=2, h2d_gbps=None, environment=ENV
    )
    assert result["status"] == "failed" and result["metrics"] is None
    assert result["reason"] == "no measured steps after 2 warm-up steps"
    validate_result(result, "test")


def _ok() -> dict[str, Any]:
    return result_from_metrics(
        _cell(), _records([1, 1, 0.5, 0.5]), warmup_steps=1, h2d_gbps=12.5, environment=ENV
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.pop("cell"), "cell is missing"),
        (lambda r: r.update(schema_version=2), "schema_version 2 is not supported (this version reads 1)"),
        (lambda r: r.update(schema="other"), "not a benchmark result"),
        (lambda r: r.update(status="great"), "status must be one of ok, failed, oom, timeout"),
        (lambda r: r["cell"].update(world_size="2"), 'cell.world_size must be integer, got "2"'),
        (lambda r: r["cell"].update(world_size=True), "cell.world_size must be integer, got true"),
        (lambda r: r["cell"].update(micro_batch_size=0), "cell.micro_batch_size must be at least 1"),
        (lambda r: r["metrics"].pop("tokens_per_s"), "metrics.tokens_per_s is missing"),
        (lambda r: r["metrics"].update(tokens_per_s=-1.0), "metrics.tokens_per_s must be positive"),
        (lambda r: r["metrics"].update(mfu="high"), 'metrics.mfu must be number or null, got "high"'),
        (
            lambda r: (
                r["metrics"].update(mfu=1.19),
                r["environment"].update(cuda={"device": "NVIDIA H100"}),
            ),
            "metrics.mfu must be at most 1: MFU 119.0% is above the devices' peak",
        ),
        (lambda r: r["metrics"]["step_time_s"].pop("p95"), "metrics.step_time_s.p95 is missing"),
        (
            lambda r: r["metrics"].update(peak_memory_bytes_per_rank=[1]),
            "one non-negative integer per rank (2)",
        ),
        (lambda r: r.update(metrics=None), "metrics must be an object when status is 'ok'"),
        (lambda r: r.update(status="oom"), "metrics must be null when status is 'oom'"),
        (
            lambda r: r.update(created="2026-01-02T03:04:05"),
            "created must be an ISO 8601 time with a UTC offset",
        ),
        (
            lambda r: r.update(created="yesterday"),
            'with a UTC offset (2026-01-02T03:04:05+00:00), got "yesterday"',
        ),
    ],
)
def test_schema_names_the_first_bad_field(edit: Any, message: str) -> None:
    result = copy.deepcopy(_ok())
    edit(result)
    with pytest.raises(UserInputError) as info:
        validate_result(result, "cells/x/result.json")
    assert str(info.value).startswith("cells/x/result.json: ") and message in str(info.value)


@pytest.mark.parametrize(
    "cell_id",
    ["../../escaped", "/tmp/victim/abs", "a/b", "a\\b", "..", ".", ".hidden", "", "a\x00b", "a b", "x" * 129],
)
def test_a_cell_id_that_is_not_one_plain_name_is_refused(cell_id: str) -> None:
    """The id names OUT/cells/<id>/ for every reader (collect, run, report, dashboard): a result whose id would
    lead elsewhere is not a result."""
    result = copy.deepcopy(_ok())
    result["cell"]["id"] = cell_id
    with pytest.raises(UserInputError) as info:
        validate_result(result, "pod.log:3")
    message = str(info.value)
    assert message.startswith("pod.log:3: cell.id: must be 1 to 128 letters, digits, '.', '_' or '-'")
    assert "\n" not in message
    if cell_id.split() == [cell_id]:  # else the marker lines are not markers: there is nothing to collect
        with pytest.raises(UserInputError, match=r"^pod\.log:1: cell\.id: must be"):
            collect_from_lines(
                _printed(result), "pod.log"
            )  # what `benchmark collect` and `deploy collect` read
    else:
        assert collect_from_lines(_printed(result), "pod.log") == []
    validate_result(
        copy.deepcopy(_ok()) | {"cell": _cell(cell_id="shakespeare-char.ddp.w2.mb4.bf16-mixed")}, "ok"
    )


def test_load_result_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    path.write_text('{"schema": ')
    with pytest.raises(UserInputError, match=rf"^benchmark result '{path}': not valid JSON at line 1"):
        load_result(path)
    write_result(_ok(), path)
    assert load_result(path) == json.loads(path.read_text())
    with pytest.raises(UserInputError, match=r"metrics\.tokens_per_s is missing"):
        bad = _ok()
        del bad["metrics"]["tokens_per_s"]
        write_result(bad, tmp_path / "bad.json")  # never written: validated first
    assert not (tmp_path / "bad.json").exists()


def _printed(result: dict[str, Any]) -> list[str]:
    buf = io.StringIO()
    print_result(result, buf)
    return buf.getvalue().splitlines()


def test_collect_from_interleaved_prefixed_lines() -> None:
    """Two results printed by rank 0s of two cells, with other ranks' lines in between and a shipper's prefix."""
    a, b = _ok(), failed_result(_cell(1, "m.fsdp.w1.mb4.32-true"), "oom", "out of memory (cuda)", warmup_steps=1,
                                environment={**ENV, "pad": "x" * 3 * CHUNK_CHARS})  # fmt: skip
    lines_a, lines_b = _printed(a), _printed(b)
    assert len(lines_b) > 4  # the padded one takes several chunks
    rng = random.Random(0)
    noise = [f"[rank1] step {i} loss 4.{i}" for i in range(40)]
    merged: list[str] = []
    queues = [lines_a, lines_b, noise]
    while any(queues):
        q = rng.choice([q for q in queues if q])
        merged.append(f"2026-11-23T10:00:00Z pod-worker-0 stdout F {q.pop(0)}")
    found = collect_from_lines(merged, "pod.log")
    assert sorted(r["cell"]["id"] for r in found) == sorted([a["cell"]["id"], b["cell"]["id"]])
    by_id = {r["cell"]["id"]: r for r in found}
    assert by_id[a["cell"]["id"]] == a and by_id[b["cell"]["id"]] == b


def test_a_damaged_or_cut_log(tmp_path: Path) -> None:
    lines = _printed(_ok())
    assert collect_from_lines(lines[:-1], "cut.log") == []  # no END: the log was cut short, nothing to report
    missing = [ln for i, ln in enumerate(lines) if i != 1]
    with pytest.raises(
        UserInputError, match=r"^lost\.log:1: result of cell m\.ddp\.w2\.mb4\.32-true is missing chunk"
    ):
        collect_from_lines(missing, "lost.log")
    mangled = list(lines)
    mangled[1] = mangled[1][:-8] + "AAAAAAAA"
    with pytest.raises(UserInputError, match="does not match its sha256"):
        collect_from_lines(mangled, "bad.log")
    log = tmp_path / "pod.log"
    log.write_text("\n".join(lines + lines) + "\n")
    assert collect_logs([log]) == [_ok() | {"created": collect_logs([log])[0]["created"]}]
    with pytest.raises(UserInputError, match="cannot read log"):
        collect_logs([tmp_path / "missing.log"])


def test_an_mfu_above_the_peak_is_named_a_measuring_bug() -> None:
    assert mfu_above_peak(None) is None and mfu_above_peak(0.45) is None and mfu_above_peak(1.0) is None
    # What an unsynchronised clock on an H100 reported: 1.18 PFLOP/s against a 989 TFLOP/s peak.
    message = mfu_above_peak(1.18)
    assert message and "MFU 118.0% is above the devices' peak" in message and "synchronise" in message
    measured = mfu_above_peak(
        2.5, peak_measured=True
    )  # a CPU's matmul peak measured while the machine was busy
    assert measured and "above the matmul peak measured at start" in measured and "busy" in measured
    # A GPU cell whose steps claim more than the datasheet peak fails with that reason instead of recording a speed.
    records = [{**r, "mfu": r["mfu"] * 1e4} for r in _records([9.0, 8.0, 0.1, 0.2]) if "mfu" in r]
    gpu = {**ENV, "cuda": {"device": "NVIDIA H100 80GB HBM3", "count": 1, "runtime": "13.0"}}
    result = result_from_metrics(_cell(), records, warmup_steps=2, h2d_gbps=None, environment=gpu)
    validate_result(result, "test")
    assert result["status"] == "failed" and result["metrics"] is None
    assert result["reason"].startswith("MFU ") and "above the devices' peak" in result["reason"]
    # On CPU the peak is itself a measurement: the figure is kept (tokens/s holds), the schema accepts it.
    cpu = result_from_metrics(_cell(), records, warmup_steps=2, h2d_gbps=None, environment=ENV)
    assert cpu["status"] == "ok" and validate_result(cpu, "test")["metrics"]["mfu"] > 1
