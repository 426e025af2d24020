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
    # fp8 is timed at the BF16 peak × its modelled gain (forecast.model)
    assert catalog_machine("h100", "fp8").peak_flops_per_rank.value == pytest.approx(989.4e12)
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


def test_an_fp8_run_is_the_bf16_step_over_fp8s_modelled_gain() -> None:
    """Only the linears run in fp8 (`tune.fp8_gain`): the FP8 dense peak × a bf16 run's MFU forecast this cell at
    twice bf16's tokens/s. Our benchmark cell (Llama 3.2 1B, micro-batch 8 × 2048, compiled, one H100, tensorwise,
    head in bf16) measured ×1.147; the forecast is the bf16 one × the modelled gain, near what it measured."""
    from gaudi3_scale.tune.fp8_gain import fp8_gain

    results = Path(__file__).parents[2] / "benchmarks" / "results" / "gpu_cuda_h100_fp8.json"
    measured_tokens_per_s = json.loads(results.read_text())["loss_after_steps"]["tokens_per_s"]
    cell = ["--parallel.nproc_per_node", "1", "--model.name", "llama3.2-1b", "--model.context_length", "2048",
            "--train.global_batch_size", "8", "--train.micro_batch_size", "8", "--train.compile", "true"]  # fmt: skip
    bf16, fp8 = (_plan(*cell, "--train.precision", p) for p in ("bf16-mixed", "fp8"))
    cfg = resolve_config(None, ["--train.device", "cuda", *cell, "--train.precision", "fp8"])
    gain = fp8_gain(run_shape(cfg, cfg.model, catalog_machine("h100", "fp8")).model, cfg.float8_plan()).gain
    assert fp8.tokens_per_s.value == pytest.approx(bf16.tokens_per_s.value * gain)  # type: ignore[operator]
    assert fp8.tokens_per_s.value == pytest.approx(measured_tokens_per_s["fp8"], rel=0.05)
    source = fp8.step["compute_s"].source
    assert "BF16 dense peak 989.4 TFLOP/s" in source and f"fp8 gain ×{gain:.3f} over bf16-mixed" in source
    assert "tune.fp8_gain" in fp8.wall["validation_s"].source


def test_a_catalog_gpus_probes_mfu_is_over_the_peak_of_the_precision_each_ran_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine whose visible GPU is the catalog's, each stored probe is over the rate its own precision is
    timed at: an fp8 probe's is the BF16 peak × its model's fp8 gain (as its step is forecast), so at MFU 0.5 it
    reads 0.5, for a bf16 forecast as for an fp8 one; an fp32 probe has no catalog peak and is left out (over the
    BF16 peak it would read far below what a bf16 run reaches)."""
    from gaudi3_scale.config.core import to_dict
    from gaudi3_scale.forecast import machine as machine_module
    from gaudi3_scale.models import get_model_config
    from gaudi3_scale.train.config import RunConfig
    from gaudi3_scale.tune.fp8_gain import fp8_gain

    model = get_model_config("llama3.2-1b").resolve_padding("cuda")
    gain = fp8_gain(model, RunConfig().float8_plan()).gain
    store = CalibrationStore(tmp_path / "store.json", machine="h100-here")

    def probe(key: str, precision: str, achieved: float) -> Probe:
        return Probe(key=key, layout={"model": to_dict(model), "precision": precision}, step_time_s=1.0,
                     warmup_s=1.0, warmup_steps=2, startup_s=1.0, validation_s=None, checkpoint_s=None,
                     peak_memory_bytes=10, flops_per_step_per_rank=achieved)  # fmt: skip

    store.add_probe(probe("fp8", "fp8", 0.5 * 989.4e12 * gain))
    store.add_probe(probe("fp32", "32-true", 0.05 * 989.4e12))
    monkeypatch.setattr(machine_module, "_local_gpu_store", lambda accelerator: store)
    for precision in ("bf16-mixed", "fp8"):
        mfu = catalog_machine("h100", precision).mfu
        assert mfu.value == pytest.approx(0.5) and "of 1 probe(s) on this machine" in mfu.source


def test_an_fp8_probe_is_keyed_and_read_with_its_own_fp8_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.fp8_* decide an fp8 step: two recipes are two layouts (two probes), and a stored fp8 probe's rate is
    over the gain of its own recipe, not the defaults'. A bf16 layout's key names no fp8 (probes stored before keep
    theirs)."""
    import dataclasses

    from gaudi3_scale.config.core import to_dict
    from gaudi3_scale.device.float8 import Float8Plan
    from gaudi3_scale.forecast import machine as machine_module
    from gaudi3_scale.forecast.run import resolve_forecast_config, run_shape
    from gaudi3_scale.models import get_model_config
    from gaudi3_scale.tune.fp8_gain import fp8_gain

    def shape(*overrides: str):  # type: ignore[no-untyped-def]
        cfg = resolve_forecast_config(
            None, ["--model.name", "llama3.2-1b", "--train.global_batch_size", "8", *overrides], "h100", None
        )
        return run_shape(
            cfg, cfg.model.resolve_padding("cuda").resolve_vocab(128256), catalog_machine("h100")
        )

    tensorwise, rowwise = shape("--train.precision", "fp8"), shape("--train.precision", "fp8",
                                                                    "--train.fp8_recipe", "rowwise")  # fmt: skip
    assert tensorwise.key != rowwise.key and rowwise.layout()["fp8"]["recipe"] == "rowwise"
    assert "fp8" not in shape("--train.precision", "bf16-mixed").layout()
    model = get_model_config("llama3.2-1b").resolve_padding("cuda")
    own = Float8Plan(recipe="rowwise", head=True, skip_small_linears=False)
    gain = fp8_gain(model, own).gain
    store = CalibrationStore(tmp_path / "store.json", machine="h100-here")
    store.add_probe(Probe(key="fp8", layout={"model": to_dict(model), "precision": "fp8",
                                             "fp8": dataclasses.asdict(own)}, step_time_s=1.0, warmup_s=1.0,
                          warmup_steps=2, startup_s=1.0, validation_s=None, checkpoint_s=None, peak_memory_bytes=10,
                          flops_per_step_per_rank=0.5 * 989.4e12 * gain))  # fmt: skip
    monkeypatch.setattr(machine_module, "_local_gpu_store", lambda accelerator: store)
    assert catalog_machine("h100", "bf16-mixed").mfu.value == pytest.approx(0.5)


def test_activation_checkpointing_recomputes_the_blocks_not_the_output_head() -> None:
    """Only the transformer blocks are checkpointed (`distributed.parallelize.apply_activation_checkpointing`):
    a step runs the blocks' FLOPs × 4/3 and the output head's 6·V·h once. GPT-2's head (its 50,304-row padded
    vocabulary × 768) is over a quarter of its FLOPs, so × 4/3 on all of them would be 7 % too many."""
    from gaudi3_scale.models import flops_per_token

    base = ["--train.device", "cuda", "--model.name", "gpt2-124m", "--train.global_batch_size", "8"]
    machine = catalog_machine("h100", "bf16-mixed")
    cfgs = [
        resolve_config(None, [*base, "--parallel.activation_checkpointing", ac]) for ac in ("false", "true")
    ]
    plain, checkpointed = (run_shape(cfg, cfg.model, machine) for cfg in cfgs)
    per_token = flops_per_token(plain.model)
    head = 6 * 50304 * 768
    assert plain.model.padded_vocab_size == 50304 and head / per_token > 0.25
    tokens = plain.batch.tokens_per_step
    assert plain.flops_per_step_per_rank() == pytest.approx(per_token * tokens)
    recomputed = head + (per_token - head) * 4 / 3
    assert checkpointed.flops_per_step_per_rank() == pytest.approx(recomputed * tokens)


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
    # 8 data-parallel ranks: 20 batches are 2 per rank (the 4 past 16 are dropped), 2000 are 250
    assert many.value == pytest.approx(125 * few.value)  # type: ignore[operator]
    assert (
        "10 pass(es) of 250 micro-batches per rank" in many.source
        and "the probe's measured rate" in many.source
    )


@pytest.mark.parametrize(
    ("ranks", "mesh", "val_batches"),
    [
        (1, [], 7),
        (8, [], 20),
        (8, [], 5),
        (8, ["--parallel.tp_size", "2"], 9),
        (8, ["--parallel.pp_size", "2"], 3),
    ],
)
def test_a_validation_pass_is_timed_for_the_batches_a_rank_runs(
    ranks: int, mesh: list[str], val_batches: int
) -> None:
    """The forecast's validation micro-batches per rank are those the data module gives each data-parallel rank."""
    from gaudi3_scale.data.sampler import val_window_starts
    from gaudi3_scale.models import flops_per_token

    cfg = resolve_config(None, ["--train.device", "cuda", "--parallel.nproc_per_node", str(ranks), "--model.name",
                                "llama3-8b", "--model.num_layers", "4", "--train.global_batch_size", "8", *mesh,
                                "--train.val_batches", str(val_batches)])  # fmt: skip
    shape = run_shape(cfg, cfg.model, catalog_machine("h100", "bf16-mixed"))
    plan, micro = shape.plan, shape.batch.micro_batch_size
    dp_ranks = plan.data_parallel_size
    runs = {len(val_window_starts(10**7, 1024, micro_batch_size=micro, max_batches=val_batches, world_size=dp_ranks,
                                  rank=r)) for r in range(dp_ranks)}  # fmt: skip
    assert runs == {shape.validation_batches_per_rank(val_batches)}
    one = dataclasses.replace(shape, plan=dataclasses.replace(plan, world_size=plan.tp_size * plan.pp_size))
    ratio = shape.validation_flops_per_rank(val_batches) / one.validation_flops_per_rank(val_batches)
    assert ratio == pytest.approx(runs.pop() / val_batches)
    # the whole forward of a micro-batch, over tensor parallel; under a pipeline the busiest rank runs its 2 of the
    # 4 blocks and the output head (forward: 2·V·h per token)
    model = shape.model
    per_token = flops_per_token(model) / 3
    if plan.pp_size > 1:
        head = 2 * model.padded_vocab_size * model.dim
        per_token = (per_token - head) / 2 + head
    tokens = micro * model.context_length * val_batches
    assert one.validation_flops_per_rank(val_batches) == pytest.approx(per_token * tokens / plan.tp_size)


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


def test_a_run_that_stopped_early_has_no_error_for_its_wall_time_and_cost() -> None:
    """`plan --compare` of a run stopped by SIGTERM after 169 of 1,308 steps: its wall time (35 s) is not 199 %
    short of a forecast of all of them; its step is compared."""
    predicted = {"predicted_step_time_s": 0.2, "predicted_wall_s": 104.7, "predicted_metered_cost_usd": 0.5}
    summary = {"step_time_s": 0.2, "wall_s": 35.0, "cost_usd": 0.17, "steps": 169, "interrupted": True,
               "stop_signal": "SIGTERM", "stop_reason": None}  # fmt: skip
    rows = {r["quantity"]: r for r in compare_with_run(predicted, summary)}
    assert rows["wall_s"]["error"] is None and rows["cost_usd"]["error"] is None
    assert rows["step_time_s"]["error"] == pytest.approx(0)
    assert any("stopped after step 169 (SIGTERM)" in line for line in format_comparison(list(rows.values())))
    ran = {r["quantity"]: r for r in compare_with_run(predicted, {**summary, "interrupted": False})}
    assert ran["wall_s"]["error"] == pytest.approx(104.7 / 35.0 - 1)


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


def test_each_collective_group_is_timed_on_the_link_it_lives_on() -> None:
    """2 nodes of 8 H100 (distributed.mesh's rank order): HSDP's 8-way shard group and a 2-stage pipeline's 8-way
    data parallel stay inside a node (NVLink, 480 GB/s per rank); only the replica all-reduce, and flat FSDP's
    16-way group, share a node's EFA (400 GB/s ÷ 8 ranks)."""
    common = ["--model.name", "llama3-8b", "--parallel.strategy", "fsdp", "--train.global_batch_size", "64",
              "--train.micro_batch_size", "1", "--parallel.activation_checkpointing", "true"]  # fmt: skip

    def plan(*overrides: str) -> Forecast:
        _, forecast = forecast_config(
            None, [*common, *overrides], machine="h100", nodes=2, warn=lambda _: None
        )
        return forecast

    flat, hsdp, pipelined = plan(), plan("--parallel.dp_replicate", "2"), plan("--parallel.pp_size", "2")
    assert "data-parallel 241 GB at 50 GB/s per rank, 8 ranks sharing" in flat.step["communication_s"].source
    hsdp_words = hsdp.step["communication_s"].source
    assert "data-parallel 225 GB at 480 GB/s per rank," in hsdp_words
    assert "replicas 4.02 GB at 50 GB/s per rank, 8 ranks sharing" in hsdp_words
    # 225 GB / 480 GB/s + 4.02 GB / 50 GB/s ≈ 0.55 s hides under 2/3 of the 4.8 s of compute
    assert hsdp.step["communication_s"].value == 0.0 < flat.step["communication_s"].value  # type: ignore[operator]
    assert hsdp.step_time_s == pytest.approx(hsdp.step["compute_s"].value)
    assert "data-parallel 21.1 GB at 480 GB/s per rank," in pipelined.step["communication_s"].source


def test_deepspeed_gradient_traffic_is_per_micro_step_and_not_hidden_behind_backward() -> None:
    """ZeRO-2 reduce-scatters after each of the 8 micro-steps (not once a step) and, overlap_comm off, on the compute
    stream; ZeRO-3's gradient reduce-scatters too, while its parameter gathers still hide behind backward."""
    one_b = ["--model.name", "llama3.2-1b", "--model.context_length", "2048", "--train.global_batch_size", "128",
             "--train.micro_batch_size", "1"]  # fmt: skip
    _, zero2 = forecast_config(None, [*one_b, "--parallel.strategy", "deepspeed_zero2"], machine="h100", nodes=2,
                               warn=lambda _: None)  # fmt: skip
    comm = zero2.step["communication_s"]
    # 16 ranks: 8 × 15/16 × 1.24e9 × 4 B of gradients + 15/16 × 1.24e9 × 2 B of parameters, at 400 GB/s ÷ 8 ranks
    assert "39.4 GB per rank per step: data-parallel 39.4 GB" in comm.source
    assert "but for the 39.4 GB DeepSpeed does not overlap" in comm.source
    assert comm.value == pytest.approx(39.4e9 / 50e9, rel=2e-3)  # none of it hidden
    assert zero2.step_time_s == pytest.approx(zero2.step["compute_s"].value + comm.value)  # type: ignore[operator]
    eight_b = [
        "--model.name",
        "llama3-8b",
        "--train.global_batch_size",
        "64",
        "--train.micro_batch_size",
        "1",
    ]
    _, zero3 = forecast_config(None, [*eight_b, "--parallel.strategy", "deepspeed_zero3"], machine="h100",
                               warn=lambda _: None)  # fmt: skip
    # one node of 8: 8 micro-steps × 7/8 × 8.03e9 × 4 B of gradients at 480 GB/s; the gathers hide under ~6 s
    gradients = 8 * 7 / 8 * 8.03e9 * 4
    assert zero3.step["communication_s"].value == pytest.approx(gradients / 480e9, rel=2e-3)


def test_untimed_communication_is_left_out_of_the_step_and_said_so() -> None:
    """4 nodes of MI300X: no sourced link bandwidth, so FSDP's ~498 GB per rank per step are not timed. The step is
    the compute alone, labelled an assumption that names the untimed traffic, not a model's "compute + exposed
    communication" with 0 s in it."""
    overrides = ["--model.name", "llama3-8b", "--parallel.strategy", "fsdp", "--train.global_batch_size", "256",
                 "--train.micro_batch_size", "1", "--parallel.activation_checkpointing", "true"]  # fmt: skip
    _, forecast = forecast_config(None, overrides, machine="mi300x", nodes=4, warn=lambda _: None)
    compute, comm = forecast.step["compute_s"], forecast.step["communication_s"]
    assert compute.value and comm.value is None
    step = forecast.step["step_time_s"]
    assert step.kind == "assumption" and step.value == pytest.approx(compute.value)
    assert (
        "communication not timed (498 GB per rank per step not timed: no sourced link bandwidth"
        in step.source
    )
    assert forecast.as_dict()["predicted_step_time_s"] == step.value
