"""The forecast's numbers are of the run asked about, or absent with the reason: the peak of the run's precision
(none for fp32 on a catalog accelerator), the fit of its memory on the device, validation at the run's own
val_batches and a probe's save only when it saved the same way, the cost of the live meter's window beside the
whole bill, and no comparison of a steady prediction with a measured mean over warm-up steps."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gaudi3_scale.forecast.calibration import CalibrationStore, Probe, machine_key
from gaudi3_scale.forecast.figures import from_catalog
from gaudi3_scale.forecast.machine import catalog_machine
from gaudi3_scale.forecast.model import Forecast, forecast_run
from gaudi3_scale.forecast.report import compare_with_run, format_comparison, format_forecast
from gaudi3_scale.forecast.run import forecast_config, run_shape
from gaudi3_scale.train.config import resolve_config

H100_BF16 = ["--model.name", "llama3-8b", "--train.global_batch_size", "16"]


def _plan(*overrides: str) -> Forecast:
    return forecast_config(None, list(overrides), machine="h100", warn=lambda line: None)[1]


def test_fp32_on_a_catalog_gpu_is_not_timed_at_the_bf16_peak() -> None:
    assert catalog_machine("h100", "bf16-mixed").peak_flops_per_rank.value == pytest.approx(989.4e12)
    assert catalog_machine("h100", "fp8").peak_flops_per_rank.value == pytest.approx(1978.9e12)
    fp32 = catalog_machine("h100", "32-true").peak_flops_per_rank
    assert fp32.value is None and "no FP32 or TF32 peak" in fp32.source
    bf16 = _plan(*H100_BF16, "--train.precision", "bf16-mixed")
    assert bf16.step_time_s and "BF16 dense peak 989.4 TFLOP/s" in bf16.step["compute_s"].source
    forecast = _plan(*H100_BF16, "--train.precision", "32-true", "--cost.price_usd_per_hour", "50")
    assert forecast.step_time_s is None and forecast.tokens_per_s.value is None
    assert forecast.wall_s is None and forecast.cost_usd.value is None and forecast.energy_kwh.value is None
    assert forecast.wall["validation_s"].value is None  # its rate is the step's: unknown too, not peak × 1
    assert "no FP32 or TF32 peak for h100-sxm" in forecast.step["step_time_s"].source
    assert forecast.as_dict()["predicted_step_time_s"] is None
    fp16 = catalog_machine("h100", "16-mixed").peak_flops_per_rank
    assert fp16.kind == "assumption" and "the catalog has no FP16 peak" in fp16.source


def test_the_forecast_says_whether_a_rank_fits_on_its_device() -> None:
    big = _plan("--model.name", "llama3-70b", "--train.global_batch_size", "8")
    assert big.fits is False and big.as_dict()["fits"] is False
    assert big.as_dict()["device_memory_bytes"]["value"] == 80e9
    text = "\n".join(format_forecast(big))
    gib = big.peak_memory_bytes / 2**30  # type: ignore[operator]
    assert f"DOES NOT FIT: {gib:,.1f} GiB > 74.5 GiB (80 GB) per rank on h100-sxm" in text
    assert (
        "of a run that cannot start" in text and big.wall_s
    )  # kept, and said to be of a run that cannot start
    small = _plan("--model.name", "gpt2-124m", "--train.global_batch_size", "8")
    assert small.fits is True and "  fits: " in "\n".join(format_forecast(small))
    assert "cannot start" not in "\n".join(format_forecast(small))


def _probe(key: str, *, checkpoint_s: float = 5.0) -> Probe:
    return Probe(key=key, layout={}, step_time_s=0.5, warmup_s=2.0, warmup_steps=2, startup_s=10.0,
                 validation_s=1.0, checkpoint_s=checkpoint_s, peak_memory_bytes=10, flops_per_step_per_rank=4e14,
                 measured_steps=20)  # fmt: skip


def _forecast(*overrides: str, probe: Probe | None = None, price: float | None = None) -> Forecast:
    cfg = resolve_config(None, ["--train.device", "cuda", "--parallel.nproc_per_node", "8", "--model.name",
                                "gpt2-124m", "--train.global_batch_size", "8", *overrides])  # fmt: skip
    machine = catalog_machine("h100", "bf16-mixed")
    shape = run_shape(cfg, cfg.model, machine)
    probe = dataclasses.replace(probe or _probe(""), key=shape.key)
    per_hour = None if price is None else from_catalog(price, "test price")
    return forecast_run(shape, machine, run_name="t", train=cfg.train, checkpoint=cfg.checkpoint, probe=probe,
                        price_usd_per_node_hour=per_hour)  # fmt: skip


def test_a_probes_validation_follows_the_runs_val_batches() -> None:
    steps = ["--train.max_steps", "1000", "--train.val_every_steps", "100"]
    few, many = (_forecast(*steps, "--train.val_batches", str(n)).wall["validation_s"] for n in (20, 2000))
    assert many.value == pytest.approx(100 * few.value)  # type: ignore[operator]
    assert "10 pass(es) of 2000 micro-batches" in many.source and "the probe's measured rate" in many.source


def test_a_probes_save_is_used_only_when_it_saved_the_same_way() -> None:
    every = ["--train.max_steps", "100", "--checkpoint.every_steps", "10"]
    saves = {
        a: _forecast(*every, "--checkpoint.async_save", a).wall["checkpoint_s"] for a in ("true", "false")
    }
    for figure in saves.values():  # stored probes do not record it: the model's figure, said so
        assert (
            figure.value != pytest.approx(10 * 5.0)
            and "does not record whether it was asynchronous" in figure.source
        )
    assert saves["true"].value == pytest.approx(saves["false"].value * 0.25)  # type: ignore[operator]
    synchronous = dataclasses.replace(_probe("k"), checkpoint_async_save=False)
    same = _forecast(*every, "--checkpoint.async_save", "false", probe=synchronous).wall["checkpoint_s"]
    assert same.value == pytest.approx(10 * 5.0) and "the probe's save (synchronous)" in same.source
    other = _forecast(*every, "--checkpoint.async_save", "true", probe=synchronous).wall["checkpoint_s"]
    assert other.value == pytest.approx(saves["true"].value) and "it was synchronous" in other.source


def test_a_fed_run_records_how_its_save_was_made_and_the_store_keeps_it(tmp_path: Path) -> None:
    from gaudi3_scale.forecast.calibration import CalibrationStore
    from gaudi3_scale.forecast.probe import probe_from_summary

    cfg = resolve_config(None, ["--train.device", "cuda", "--model.name", "gpt2-124m"])
    shape = run_shape(cfg, cfg.model, catalog_machine("h100", "bf16-mixed"))
    summary = {"step_time_s": 0.5, "measured_steps": 10, "warmup_s": 1.0, "wall_s": 30.0, "warmup_steps": 2,
               "peak_memory_bytes": 10, "checkpoint_blocking_s": [0.2, 0.3]}  # fmt: skip
    saved = probe_from_summary(summary, shape, val_batches=2, async_save=True)
    assert (saved.checkpoint_s, saved.checkpoint_async_save) == (0.3, True)
    # a summary since the list holds the newest saves only: the longest of all of them is its own field
    longest = probe_from_summary({**summary, "checkpoint_blocking_max_s": 0.9}, shape, val_batches=2)
    assert longest.checkpoint_s == 0.9
    unsaved = probe_from_summary(
        {**summary, "checkpoint_blocking_s": []}, shape, val_batches=2, async_save=True
    )
    assert (unsaved.checkpoint_s, unsaved.checkpoint_async_save) == (
        None,
        None,
    )  # no save: nothing to say of it
    store = CalibrationStore(tmp_path / "store.json", machine="m")
    store.add_probe(saved)
    assert (
        CalibrationStore(tmp_path / "store.json", machine="m").probes[saved.key].checkpoint_async_save is True
    )


def test_the_metered_cost_leaves_out_what_the_live_meter_does_not_bill() -> None:
    price = 3600.0  # $1 a second per node
    forecast = _forecast("--train.max_steps", "100", "--train.val_every_steps", "50", "--checkpoint.every_steps",
                         "25", price=price)  # fmt: skip
    wall = {k: v.value or 0.0 for k, v in forecast.wall.items()}
    assert forecast.cost_usd.value == pytest.approx(wall["wall_s"])
    # the meter: fit start to the last step — no startup, and of 2 validations and 4 saves, the last one of each
    metered = wall["warmup_s"] + wall["steady_s"] + wall["validation_s"] / 2 + wall["checkpoint_s"] * 3 / 4
    assert forecast.metered_cost_usd.value == pytest.approx(metered)
    assert forecast.as_dict()["predicted_metered_cost_usd"] == pytest.approx(metered)
    summary = {"cost_usd": metered, "step_time_s": 0.5, "tokens_per_s": 1.0}
    rows = {r["quantity"]: r for r in compare_with_run(forecast.summary_fields(), summary)}
    assert rows["cost_usd"]["predicted"] == pytest.approx(metered) and rows["cost_usd"][
        "error"
    ] == pytest.approx(0)
    assert "fit start to the last step" in "\n".join(format_comparison(list(rows.values())))


def test_a_measured_mean_over_warmup_steps_is_not_compared_with_the_steady_step() -> None:
    predicted = {"predicted_step_time_s": 0.09, "predicted_tokens_per_s": 8000.0, "predicted_wall_s": 3.0}
    summary = {"step_time_s": 1.2, "tokens_per_s": 650.0, "wall_s": 2.7, "throughput_includes_warmup": True}
    rows = {r["quantity"]: r for r in compare_with_run(predicted, summary)}
    assert rows["step_time_s"]["error"] is None and rows["tokens_per_s"]["error"] is None
    assert rows["step_time_s"]["measured"] == 1.2 and rows["wall_s"]["error"] == pytest.approx(3.0 / 2.7 - 1)
    lines = format_comparison(list(rows.values()))
    assert any(line.startswith("step_time_s*") and line.endswith("—") for line in lines)
    assert any("measured over warm-up steps" in line for line in lines)
    steady = {
        r["quantity"]: r
        for r in compare_with_run(predicted, {**summary, "throughput_includes_warmup": False})
    }
    assert steady["step_time_s"]["error"] == pytest.approx(0.09 / 1.2 - 1)


def test_gaudi3_plan_prints_the_fit_and_the_untimed_fp32_step(tmp_path: Path) -> None:
    env = {**os.environ, "GAUDI3_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "plan", "--out", "p.json", "--machine", "h100", "--model.name",
         "llama3-70b", "--train.global_batch_size", "8", "--train.precision", "32-true"],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "  DOES NOT FIT: " in done.stdout and "> 74.5 GiB (80 GB) per rank on h100-sxm" in done.stdout
    step = next(line for line in done.stdout.splitlines() if line.startswith("  step_time"))
    assert "unknown" in step and "no FP32 or TF32 peak" in step
    written = json.loads((tmp_path / "p.json").read_text())
    assert written["fits"] is False and written["predicted_step_time_s"] is None


def _seed_cpu_store(peaks: dict[int, float]) -> CalibrationStore:
    """This machine's calibration store (under $GAUDI3_CACHE) with known `cpu-<threads>-threads` peaks."""
    from gaudi3_scale.device.select import cpu_model_name, usable_cpu_cores

    store = CalibrationStore.for_machine(machine_key(cpu_model_name(), usable_cpu_cores()))
    for threads, flops in peaks.items():
        store.set_peak(f"cpu-{threads}-threads", flops)
    return store


def test_a_cpu_forecast_is_timed_at_the_peak_of_the_threads_its_ranks_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.threads other than the default (usable cores ÷ ranks) is timed at its own stored peak, not the
    default's: the compute time scales by the ratio of the two peaks (no probes: the same assumed MFU)."""
    from gaudi3_scale.device.select import cpu_threads_per_rank
    from gaudi3_scale.forecast.run import machine_for

    monkeypatch.setenv("GAUDI3_CACHE", str(tmp_path))
    default = cpu_threads_per_rank(1)
    other = 1 if default > 1 else 2  # a thread count the run does not get by default
    store = _seed_cpu_store({default: 4e10, other: 1e10})
    base = ["--train.device", "cpu", "--model.num_layers", "1"]
    cfg, by_default = forecast_config(None, base, warn=lambda line: None)
    cfg_other, at_other = forecast_config(
        None, [*base, "--train.threads", str(other)], warn=lambda line: None
    )
    assert f"with {other} thread(s)" in machine_for(cfg_other, None).peak_flops_per_rank.source
    assert f"with {default} thread(s)" in machine_for(cfg, None).peak_flops_per_rank.source
    assert "measured peak 0.01 TFLOP/s" in at_other.step["compute_s"].source
    assert "measured peak 0.04 TFLOP/s" in by_default.step["compute_s"].source
    ratio = at_other.step["compute_s"].value / by_default.step["compute_s"].value  # type: ignore[operator]
    assert ratio == pytest.approx(4e10 / 1e10)
    assert at_other.run["layout"]["threads"] == other and "threads" not in by_default.run["layout"]
    assert set(CalibrationStore.for_machine(store.machine).peaks) == {f"cpu-{default}-threads",
                                                                      f"cpu-{other}-threads"}  # fmt: skip


def test_a_cpu_probes_mfu_is_over_the_peak_of_the_threads_it_ran_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two probes at `other` threads and one at the default each reach half their own threads' peak: the MFU is
    0.5, not the 1e10 / 4e10 / 2 a probe of `other` threads would seem to reach over the default's peak."""
    from gaudi3_scale.device.select import cpu_threads_per_rank
    from gaudi3_scale.forecast.machine import this_cpu

    monkeypatch.setenv("GAUDI3_CACHE", str(tmp_path))
    default = cpu_threads_per_rank(1)
    other = 1 if default > 1 else 2
    store = _seed_cpu_store({default: 4e10, other: 1e10})

    def probe(key: str, threads: dict[str, int], achieved: float) -> Probe:
        return Probe(key=key, layout={"world_size": 1, **threads}, step_time_s=1.0, warmup_s=1.0, warmup_steps=2,
                     startup_s=1.0, validation_s=None, checkpoint_s=None, peak_memory_bytes=10,
                     flops_per_step_per_rank=achieved)  # fmt: skip

    store.add_probe(probe("a", {"threads": other}, 0.5e10))
    store.add_probe(probe("b", {"threads": other}, 0.5e10))
    store.add_probe(probe("c", {}, 2e10))
    for threads in (None, other):
        assert this_cpu(1, threads=threads).mfu.value == pytest.approx(0.5)
