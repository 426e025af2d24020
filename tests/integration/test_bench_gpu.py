"""benchmarks/bench_gpu.py keeps working on CPU (its tiny cell set), so a GPU session only has to run it."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"


def test_bench_gpu_runs_both_sides_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_cpu.json"
    # A cell stored by an earlier run on another machine keeps its own provenance when this run merges in.
    old_with = {"machine": {"cpu": "older CPU", "git_commit": "9d85963", "date": "2026-11-25"}, "peak_flops": 1.88e11,
                "peak_source": "measured then"}  # fmt: skip
    old_cell = {"cell": {"name": "tiny-compiled"}, "plain": {"ms_per_step": 7.7}, "gaudi3": {"ms_per_step": 7.7},
                "ratio_tokens_per_s": 1.0, "measured_with": old_with}  # fmt: skip
    # ... and this cell's stored fp8 loss check (measured apart) outlives a timing rerun without one (--no-loss)
    loss_check = {"bf16-mixed": 6.2, "fp8": 6.21, "measured_with": old_with}
    out.write_text(json.dumps({"cells": {"tiny-compiled": old_cell,
                                         "tiny-eager": {"cell": {"name": "tiny-eager"}, "loss_after_steps": loss_check}}}))  # fmt: skip
    args = ["--small", "--cells", "tiny-eager", "--repeats", "1", "--measured-steps", "12", "--no-loss"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    cell = result["cells"]["tiny-eager"]
    for side in ("plain", "gaudi3"):
        # MFU against this CPU's matmul peak measured once before the cells: on a shared 2-core machine a side can
        # run while the other test worker is idle and beat a peak measured while it was busy (CI: 1.07), so > 0 only.
        assert cell[side]["ms_per_step"] > 0 and cell[side]["mfu"] > 0, cell
        (run,) = cell["runs"][side]
        # Uniformly random ids over 512: a model that trains on them sits at ln(512) = 6.24 nats.
        assert run["final_loss"] == pytest.approx(math.log(512), abs=0.3), run
    assert cell["ratio_tokens_per_s"] == pytest.approx(
        cell["gaudi3"]["tokens_per_s"] / cell["plain"]["tokens_per_s"]
    )
    assert cell["runs"]["gaudi3"][0]["measured_steps"] == 12
    # Per-window times at gaudi3 train's record steps (10 and the last, 14), for both sides; the plain loop's
    # windows start after its warm-up (2 steps), so they average to its measured step time.
    plain, ours = cell["runs"]["plain"][0], cell["runs"]["gaudi3"][0]
    assert [w["step"] for w in plain["windows"]] == [w["step"] for w in ours["windows"]] == [10, 14]
    assert all(w["ms_per_step"] > 0 for w in plain["windows"] + ours["windows"])
    mean_ms = (plain["windows"][0]["ms_per_step"] * 8 + plain["windows"][1]["ms_per_step"] * 4) / 12
    assert mean_ms == pytest.approx(plain["step_time_s"] * 1e3, rel=0.02)
    assert result["machine"]["packages"]["torch"] and result["peak_source"].startswith("measured")
    assert cell["measured_with"] == {"machine": result["machine"], "peak_flops": result["peak_flops"],
                                     "peak_source": result["peak_source"]}  # fmt: skip
    assert result["cells"]["tiny-compiled"] == old_cell and cell["loss_after_steps"] == loss_check
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "tiny-eager" in done.stdout and "×" in done.stdout

    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--cells", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown cell(s) nope; valid: tiny-eager, tiny-compiled" in bad.stderr


@pytest.mark.parametrize(
    ("flag", "value"), [("--measured-steps", "-3"), ("--repeats", "0"), ("--loss-seeds", "x")]
)
def test_bad_counts_are_one_line_and_exit_2(tmp_path: Path, flag: str, value: str) -> None:
    out = tmp_path / "r.json"
    bad = subprocess.run([sys.executable, str(SCRIPT), "--small", flag, value, "--out", str(out)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and f"argument {flag}:" in bad.stderr and "Traceback" not in bad.stderr
    assert not out.exists()


def test_a_failed_cell_is_kept_beside_the_stored_good_one() -> None:
    """What main() does with each cell's summary: one whose runs failed never replaces a stored good one."""
    from gaudi3_scale.bench.result import keep_good_entry

    bench_gpu = _load()
    tiny = bench_gpu.CPU_CELLS[0]
    ok_run = {"status": "ok", "step_time_s": 0.01}
    good = bench_gpu.summarize(tiny, {"plain": [ok_run], "gaudi3": [ok_run]}, 1e11)
    failed = bench_gpu.summarize(
        tiny, {"plain": [{"status": "failed", "reason": ["OOM"]}], "gaudi3": [ok_run]}, 1e11
    )
    cells = {tiny.name: good}
    assert not keep_good_entry(cells, tiny.name, failed, bench_gpu._cell_ok)
    assert cells[tiny.name]["plain"] == good["plain"] and cells[tiny.name]["failed_attempts"] == [failed]
    # with nothing good stored, the failed cell is what there is
    assert keep_good_entry(cells, "other", failed, bench_gpu._cell_ok) and cells["other"] is failed
    # the loss gap keeps its sign: fp8 above bf16 is positive, below negative
    assert bench_gpu._relative_gap(2.02, 2.0) == pytest.approx(0.01)
    assert bench_gpu._relative_gap(1.98, 2.0) == pytest.approx(-0.01)


def test_a_truncated_results_file_is_refused_not_replaced(tmp_path: Path) -> None:
    out = tmp_path / "gpu_cpu.json"
    out.write_text('{"cells": {"tiny-eager": {"pla')
    done = subprocess.run([sys.executable, str(SCRIPT), "--small", "--cells", "tiny-eager", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "cannot merge into" in done.stderr and "Traceback" not in done.stderr
    assert out.read_text() == '{"cells": {"tiny-eager": {"pla'


def test_bench_gpu_profile_diffs_the_two_loops_steps(tmp_path: Path) -> None:
    # --out is the timing results: the profile goes beside it (gpu_cpu_profile.json), merged by cell.
    out, profile_out = tmp_path / "gpu_cpu.json", tmp_path / "gpu_cpu_profile.json"
    timings = json.dumps({"cells": {"tiny-eager": {"plain": {"ms_per_step": 10.0}}}, "ablation": {"a": {}}})
    out.write_text(timings)
    profile_out.write_text(json.dumps({"cells": {"tiny-compiled": {"profiled_steps": 5}}}))
    args = ["--small", "--cells", "tiny-eager", "--measured-steps", "3", "--profile", "2", "--out", str(out)]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert out.read_text() == timings
    profiles = json.loads(profile_out.read_text())
    assert profiles["cells"]["tiny-compiled"] == {"profiled_steps": 5}
    cell = profiles["cells"]["tiny-eager"]
    assert cell["profiled_steps"] == 2
    per_step = cell["diff"]["per_step"]
    assert per_step["step_ms"]["plain"] > 0 and per_step["step_ms"]["gaudi3"] > 0
    # Both sides run the same model math: no matmul or optimizer kernel differs in count between them.
    differing = {row["name"] for row in cell["diff"]["op_calls"]}
    assert not differing & {"aten::mm", "aten::addmm", "aten::_fused_adamw_", "aten::bmm"}, differing
    assert "tiny-eager: per step, plain vs gaudi3" in done.stdout

    bad = subprocess.run(
        [sys.executable, str(SCRIPT), *args[:5], "--profile", "4"], capture_output=True, text=True
    )
    assert (
        bad.returncode == 2
        and "--profile must be between 1 and each cell's measured steps, got 4" in bad.stderr
    )


def test_one_ablation_pair_by_its_label(tmp_path: Path) -> None:
    """`--ablation LABEL` runs only that default-vs-variant pair, both sides, with --measured-steps applied."""
    out = tmp_path / "ablation.json"
    args = ["--small", "--ablation", "vocab padded to 64", "--repeats", "1", "--measured-steps", "12"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ablation = json.loads(out.read_text())["ablation"]
    assert list(ablation) == ["char-eager | vocab padded to 64"]  # not "loss outside compile"
    pair = ablation["char-eager | vocab padded to 64"]
    for side in ("plain", "gaudi3"):
        assert pair[side]["default_ms_per_step"] > 0 and pair[side]["variant_ms_per_step"] > 0, pair
        assert pair[side]["variant_step_time_over_default"] == pytest.approx(
            pair[side]["variant_ms_per_step"] / pair[side]["default_ms_per_step"]
        )
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--ablation", "max-autotun"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and (
        "unknown ablation(s) max-autotun; valid: vocab padded to 64, loss outside compile" in bad.stderr
    )


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    assert spec and spec.loader
    bench_gpu = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = bench_gpu  # dataclasses look their module up by name
    spec.loader.exec_module(bench_gpu)
    return bench_gpu


def test_the_fp8_loss_check_records_both_runs_and_a_refusal(tmp_path: Path) -> None:
    """The fp8 cells' 200-step check, on CPU: bf16 trains, fp8 is refused there, and both outcomes are recorded."""
    bench_gpu = _load()
    tiny = bench_gpu.CPU_CELLS[0]
    cell = bench_gpu.Cell(**{**asdict(tiny), "name": "tiny-fp8", "precision": "fp8", "loss_steps": 8,
                             "fp8_recipe": "rowwise", "fp8_head": True, "fp8_skip_small_linears": True})  # fmt: skip
    fp8_args = bench_gpu.gaudi3_overrides(cell, steps=8, warmup=1, source="synthetic")
    assert {
        "--train.fp8_recipe=rowwise",
        "--train.fp8_head=true",
        "--train.fp8_skip_small_linears=true",
    } <= set(fp8_args)
    results: dict = {"cells": {}}
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")}
    assert bench_gpu._loss_check([cell], env, results, tmp_path / "loss.json") == ["tiny-fp8 (loss check)"]
    check = json.loads((tmp_path / "loss.json").read_text())["cells"]["tiny-fp8"]["loss_after_steps"]
    # The bf16 run gets no fp8 option (refused without train.precision fp8), so it trains.
    assert check["steps"] == 8 and 0 < check["bf16-mixed"] < 7 and check["tokens_per_s"]["bf16-mixed"] > 0
    assert check["fp8"] is None and check["relative"] is None and check["fp8_over_bf16_tokens_per_s"] is None
    assert any("fp8" in line and "compute capability" in line for line in check["failed"]["fp8"]), check
    assert check["mfu"]["bf16-mixed"] > 0 and check["peak_memory_bytes"]["fp8"] is None
    assert 0 < check["val_loss"]["bf16-mixed"] < 7 and check["val_loss"]["fp8"] is None
    assert check["val_relative"] is None and check["fp8_minus_bf16_relative"] is None
    # Each run keeps its directory and output, so a run a time limit stops still shows how far it got.
    runs = tmp_path / "loss_runs"
    bf16_run = runs / "tiny-fp8-bf16-mixed"
    records = [json.loads(line) for line in (bf16_run / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 8
    summary = json.loads((bf16_run / "run" / "summary.json").read_text())
    assert (summary["train_loss"], summary["val_loss"]) == (
        check["bf16-mixed"],
        check["val_loss"]["bf16-mixed"],
    )
    assert "compute capability" in (runs / "tiny-fp8-fp8" / "train.log").read_text()
    # A second bench replaces them (gaudi3 train's --resume never would refuse an existing run); with two seeds each
    # precision runs twice, and the bf16 runs' spread is the noise band.
    # A stored check whose runs all finished is not replaced by one whose fp8 run failed: kept, the attempt beside.
    good = {"steps": 8, "bf16-mixed": 5.0, "fp8": 5.1, "relative": 0.02, "fp8_minus_bf16_relative": 0.02}
    results["cells"]["tiny-fp8"]["loss_after_steps"] = dict(good)
    bench_gpu._loss_check([cell], env, results, tmp_path / "loss.json", seeds=2)
    kept = json.loads((tmp_path / "loss.json").read_text())["cells"]["tiny-fp8"]["loss_after_steps"]
    assert {k: kept[k] for k in good} == good
    (check,) = kept["failed_attempts"]
    seeded = check["per_seed"]["train_loss"]["bf16-mixed"]
    assert check["seeds"] == 2 and len(seeded) == 2 and seeded[0] != seeded[1]  # --seed reached the runs
    assert check["bf16-mixed"] == pytest.approx(sum(seeded) / 2)
    assert check["bf16_seed_spread"] == pytest.approx(abs(seeded[0] - seeded[1]) / (sum(seeded) / 2))
    assert check["per_seed"]["train_loss"]["fp8"] == [None, None] and check["fp8"] is None
    assert set(check["failed"]) == {"fp8 seed 0", "fp8 seed 1"}
    assert (runs / "tiny-fp8-bf16-mixed-seed1" / "run" / "summary.json").is_file()
    config = (runs / "tiny-fp8-bf16-mixed-seed1" / "run").glob("*.yaml")
    assert any("val_batches: 20" in path.read_text() for path in config)


def _children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:  # fields: state, ppid, ...
                found.add(int(stat.parent.name))
    return found


def test_a_terminated_bench_takes_its_running_child_with_it(tmp_path: Path) -> None:
    """`timeout 240 python bench_gpu.py …` sends SIGTERM to the bench only: the training it had started must not
    go on running (on the GPU machine it would share the device with the next measurement)."""
    args = [
        "--small",
        "--cells",
        "tiny-eager",
        "--repeats",
        "1",
        "--no-loss",
        "--out",
        str(tmp_path / "r.json"),
    ]
    bench = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    children: set[int] = set()
    while not children and time.monotonic() < deadline and bench.poll() is None:
        children = _children(bench.pid)
        time.sleep(0.05)
    assert children, "the bench started no child"
    bench.send_signal(signal.SIGTERM)
    code = bench.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in children if Path(f"/proc/{pid}/stat").exists()
             and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]  # fmt: skip
    assert not alive, f"children still running after the bench ended: {alive}"
    assert code == 128 + signal.SIGTERM
