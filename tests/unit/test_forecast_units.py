"""The forecast's pieces: the collectives' bytes per layout (against the ring formulas by hand), the calibration
store (peak kept, probes keyed by layout, a foreign store refused), and the comparison with a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.forecast.calibration import CalibrationStore, Probe
from gaudi3_scale.forecast.comm import step_collective_bytes
from gaudi3_scale.forecast.report import compare_with_run
from gaudi3_scale.models import ModelConfig

P = 1_000_000
MODEL = ModelConfig(name="m", dim=64, num_layers=2, num_heads=4, context_length=32, vocab_size=100)


def _bytes(strategy: str, world: int, *, accumulation: int = 1, tp: int = 1, param_bytes: int = 4) -> float:
    plan = ParallelPlan.build(strategy=strategy, world_size=world, tp_size=tp)
    batch = BatchPlan.build(global_batch_size=2 * accumulation * (world // tp), micro_batch_size=2,
                            data_parallel_size=world // tp, context_length=32)  # fmt: skip
    return step_collective_bytes(MODEL, plan, batch, parameters=P, param_bytes=param_bytes).total


def test_collective_bytes_follow_the_ring_formulas() -> None:
    assert _bytes("ddp", 2) == pytest.approx(2 * 0.5 * P * 4)  # one fp32 all-reduce a step
    assert _bytes("ddp", 4, accumulation=3) == pytest.approx(2 * 0.75 * P * 4)  # micro-steps skip the sync
    # FSDP: per micro-step, two all-gathers of the parameters and a reduce-scatter of fp32 gradients
    assert _bytes("fsdp", 2) == pytest.approx(0.5 * P * (2 * 4 + 4))
    assert _bytes("fsdp", 2, accumulation=3, param_bytes=2) == pytest.approx(3 * 0.5 * P * (2 * 2 + 4))
    assert _bytes("fsdp", 1) == 0.0
    # DeepSpeed ZeRO-2: a gradient reduce-scatter after every micro-step's backward, one parameter all-gather a step
    assert _bytes("deepspeed_zero2", 2, accumulation=3, param_bytes=2) == pytest.approx(0.5 * P * (3 * 4 + 2))
    # tensor parallel 2 on 2 ranks: 4 activation all-reduces per layer per micro-step, no data parallel
    activation = 2 * 32 * 64 * 4
    assert _bytes("fsdp", 2, tp=2) == pytest.approx(MODEL.num_layers * 4 * 2 * 0.5 * activation)


def test_deepspeed_collectives_on_the_compute_stream_are_counted_apart() -> None:
    """overlap_comm off (distributed.plan.ZERO_OVERLAP_COMM, what distributed.deepspeed sets): ZeRO-2's and ZeRO-3's
    gradient reduce-scatters, and ZeRO-2's parameter all-gather after the step, cannot hide behind backward;
    ZeRO-3's prefetched gathers can."""
    plan = ParallelPlan.build(strategy="deepspeed_zero2", world_size=2)
    batch = BatchPlan.build(global_batch_size=12, micro_batch_size=2, data_parallel_size=2, context_length=32)
    zero2 = step_collective_bytes(MODEL, plan, batch, parameters=P, param_bytes=2)
    assert zero2.serial == zero2.data_parallel == pytest.approx(0.5 * P * (3 * 4 + 2))
    plan = ParallelPlan.build(strategy="deepspeed_zero3", world_size=2)
    zero3 = step_collective_bytes(MODEL, plan, batch, parameters=P, param_bytes=2)
    assert zero3.data_parallel == pytest.approx(3 * 0.5 * P * (2 * 2 + 4)) and zero3.serial == pytest.approx(
        3 * 0.5 * P * 4
    )


def _probe(key: str, step: float) -> Probe:
    return Probe(key=key, layout={"k": key}, step_time_s=step, warmup_s=1.0, warmup_steps=2, startup_s=3.0,
                 validation_s=0.5, checkpoint_s=0.1, peak_memory_bytes=10, flops_per_step_per_rank=1e9)  # fmt: skip


def test_the_store_keeps_the_peak_and_the_probes_across_processes(tmp_path: Path) -> None:
    store = CalibrationStore(tmp_path / "m.json", machine="m")
    assert store.peak("cpu-2-threads") is None
    store.set_peak("cpu-2-threads", 5e10)
    store.add_probe(_probe("a", 0.5))
    again = CalibrationStore(tmp_path / "m.json", machine="m")
    assert again.peak("cpu-2-threads")[0] == 5e10  # type: ignore[index]
    assert again.probes["a"].achieved_flops_per_rank == pytest.approx(2e9)
    assert [p.key for p in again.others("b")] == ["a"] and again.others("a") == []
    with pytest.raises(UserInputError, match="not a calibration store of this machine"):
        CalibrationStore(tmp_path / "m.json", machine="another")
    (tmp_path / "m.json").write_text("{not json")
    with pytest.raises(UserInputError, match="delete it to start a new one"):
        CalibrationStore(tmp_path / "m.json", machine="m")


def test_one_store_is_read_by_older_and_newer_versions_alike(tmp_path: Path) -> None:
    """Versions before Probe.checkpoint_async_save refuse a field they do not know: it is stored only when
    recorded; and a field a newer version added is set aside here, not a "damaged store, delete it"."""
    store = CalibrationStore(tmp_path / "m.json", machine="m")
    store.add_probe(_probe("a", 0.5))
    stored = json.loads((tmp_path / "m.json").read_text())
    assert (
        "checkpoint_async_save" not in stored["probes"]["a"]
    )  # not recorded: left out, as older versions wrote it
    stored["probes"]["a"]["a_field_of_a_newer_version"] = 1
    (tmp_path / "m.json").write_text(json.dumps(stored))
    assert CalibrationStore(tmp_path / "m.json", machine="m").probes["a"].step_time_s == 0.5


def test_a_short_trial_does_not_replace_a_longer_probe_but_an_explicit_probe_does(tmp_path: Path) -> None:
    from dataclasses import replace

    store = CalibrationStore(tmp_path / "m.json", machine="m")
    long = replace(_probe("a", 0.1), measured_steps=100)  # 10 s of steps (gaudi3 plan --probe)
    assert store.add_probe(long)
    trial = replace(_probe("a", 0.2), measured_steps=5, origin="tune trial t")  # 1 s
    assert not store.add_probe(trial, keep_longer=True)
    assert CalibrationStore(tmp_path / "m.json", machine="m").probes["a"].step_time_s == 0.1
    longer = replace(trial, measured_steps=60)  # 12 s: more than the stored one
    assert store.add_probe(longer, keep_longer=True) and store.probes["a"].origin == "tune trial t"
    assert store.add_probe(replace(_probe("a", 0.3), measured_steps=1))  # --probe replaces whatever is there
    assert store.probes["a"].step_time_s == 0.3


def test_a_comparison_gives_the_error_of_each_known_quantity() -> None:
    predicted = {"predicted_step_time_s": 1.1, "predicted_wall_s": 90.0, "predicted_peak_memory_bytes": 100,
                 "predicted_tokens_per_s": 1000.0, "predicted_cost_usd": None}  # fmt: skip
    summary = json.loads(json.dumps({"step_time_s": 1.0, "wall_s": 100.0, "peak_memory_bytes": 125,
                                     "tokens_per_s": 1000.0, "cost_usd": 2.0}))  # fmt: skip
    rows = {row["quantity"]: row["error"] for row in compare_with_run(predicted, summary)}
    assert rows["step_time_s"] == pytest.approx(0.1) and rows["wall_s"] == pytest.approx(-0.1)
    assert rows["peak_memory_bytes"] == pytest.approx(-0.2) and rows["tokens_per_s"] == 0.0
    assert rows["cost_usd"] is None  # predicted unknown: no error, never a guess


def test_the_probe_measures_about_ten_seconds_of_steps() -> None:
    from gaudi3_scale.forecast.probe import PROBE_MEASURED_S, probe_measured_steps

    assert probe_measured_steps(0.04) == round(PROBE_MEASURED_S / 0.04)  # a fast step: many of them
    assert probe_measured_steps(5.0) == 10  # a slow one: at least 10
    assert probe_measured_steps(1e-4) == 300  # at most 300
    assert probe_measured_steps(None) == 10  # no first guess


def test_gaudi3_links_are_sourced_spec_ceilings() -> None:
    from gaudi3_scale.forecast.machine import catalog_machine

    machine = catalog_machine("gaudi3", "bf16-mixed")
    assert machine.intra_node_bytes_per_s.value == 525e9
    assert machine.inter_node_bytes_per_s.value == 600e9
    assert "Intel Gaudi Network Configuration" in machine.inter_node_bytes_per_s.source


def test_a_run_feeds_the_store_only_when_ok_here_and_of_its_own_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """forecast.feed refuses, with one note each, a failed run, a run without its summary, one that ran on another
    machine and one whose recorded layout key is not its config's here; the same run recorded here is stored. A
    store of its own: another test's run of the default config (a tuning trial) would already have stored this
    layout in the session's."""
    monkeypatch.setenv("GAUDI3_CACHE", str(tmp_path / "cache"))
    from gaudi3_scale.config.core import save_yaml
    from gaudi3_scale.forecast.feed import feed_run
    from gaudi3_scale.forecast.run import machine_for, run_shape
    from gaudi3_scale.train.config import resolve_config

    cfg = resolve_config(None, ["--model.vocab_size", "65", "--train.device", "cpu"])
    machine = machine_for(cfg, None)
    assert machine.store is not None
    shape = run_shape(cfg, cfg.model, machine)
    save_yaml(cfg, tmp_path / "config.yaml")
    summary = {"step_time_s": 0.05, "measured_steps": 10, "warmup_steps": 2, "warmup_s": 0.2, "wall_s": 9.0,
               "peak_memory_bytes": 400_000_000, "checkpoint_blocking_s": [], "interrupted": False}  # fmt: skip

    def feed(run: dict[str, object], *, status: str = "ok") -> str:
        (tmp_path / "plan.json").write_text(json.dumps({"run": run}))
        return feed_run(tmp_path, status=status, origin=f"tune trial {tmp_path}")

    here = {"calibration_machine": machine.store.machine, "probe_key": shape.key}
    assert feed(here, status="oom").startswith("calibration store: not fed (oom: ")
    assert "has no summary.json" in feed(here)
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert "it ran on cpu-elsewhere-2c-0000, not on this one" in feed(
        {**here, "calibration_machine": "cpu-elsewhere-2c-0000"}
    )
    assert "its layout key 0123 is not the" in feed({**here, "probe_key": "0123"})
    assert shape.key not in CalibrationStore(machine.store.path, machine=machine.store.machine).probes
    assert feed(here).startswith("calibration store: probe of this layout stored (0.05 s a step)")
    probe = CalibrationStore(machine.store.path, machine=machine.store.machine).probes[shape.key]
    assert probe.origin == f"tune trial {tmp_path}" and probe.step_time_s == 0.05
    assert probe.source().startswith(f"probe of this layout, from tune trial {tmp_path}, ")


def _committed(checkpoints: Path, step: int, cost_usd: float) -> Path:
    from gaudi3_scale.checkpoint.manifest import write_manifest

    directory = checkpoints / f"step-{step:08d}"
    directory.mkdir(parents=True)
    (directory / "state.ckpt").write_bytes(b"weights")
    write_manifest(directory, {"step": step, "cost_usd": cost_usd})
    return directory


def test_the_forecast_of_a_resumed_run_reads_the_step_its_resume_will_take(tmp_path: Path) -> None:
    from gaudi3_scale.train.config import resolve_config
    from gaudi3_scale.train.resume import resume_manifest

    out = tmp_path / "run"

    def manifest(*overrides: str) -> dict | None:
        cfg = resolve_config(None, ["--out_dir", str(out), "--train.max_steps", "100", *overrides])
        return resume_manifest(cfg)

    assert manifest() is None  # nothing saved yet: a fresh start
    _committed(out / "checkpoints", 20, 1.5)
    newest = _committed(out / "checkpoints", 40, 3.0)
    (out / "checkpoints" / "step-00000060").mkdir()  # never committed: not a resume point
    assert manifest()["step"] == 40  # auto without a pointer: the newest committed
    (out / "checkpoints" / "latest").write_text("step-00000020\n")
    assert manifest()["step"] == 20  # the pointer's target first, as `auto` takes it
    assert manifest("--train.resume", "never") is None
    assert manifest("--train.resume", str(newest / "state.ckpt"))["cost_usd"] == 3.0
    assert manifest("--train.resume", str(out))["step"] == 20  # a run directory: its pointer's


def test_a_resumed_runs_forecast_counts_the_spend_it_recorded_after_its_checkpoint(tmp_path: Path) -> None:
    """A process killed without a stop (SIGKILL) recorded $5 in metrics.jsonl after a checkpoint of $3: the
    resumed meter starts from $5 (`metering.live.resumed_cost_usd`), and so does the forecast's cost."""
    from gaudi3_scale.forecast.run import forecast_for_training
    from gaudi3_scale.train.config import resolve_config
    from gaudi3_scale.tune.estimate_table import resolved_model

    out = tmp_path / "run"
    cfg = resolve_config(None, ["--out_dir", str(out), "--train.max_steps", "100", "--model.num_layers", "1",
                                "--cost.price_usd_per_hour", "3600"])  # fmt: skip
    model = resolved_model(cfg.model, cfg.data)
    _committed(out / "checkpoints", 40, 3.0)

    def spent() -> float:
        forecast = forecast_for_training(cfg, model)
        assert forecast.run["start_step"] == 40 and forecast.cost_usd.value and forecast.wall_s
        return forecast.cost_usd.value - forecast.wall_s  # $1 a second of this process's wall time

    assert spent() == pytest.approx(3.0)
    (out / "metrics.jsonl").write_text('{"step": 40, "cost_usd": 3.0}\n{"step": 45, "cost_usd": 5.0}\n')
    assert spent() == pytest.approx(5.0)


def test_with_no_local_checkpoint_the_forecast_reads_the_remote_mirrors_manifest(tmp_path: Path) -> None:
    """A fresh machine resumes from `checkpoint.remote_url` alone: its forecast starts at the step it will download
    (a real fsspec store, file://, of committed, uncommitted and damaged checkpoints)."""
    from gaudi3_scale.train.config import resolve_config
    from gaudi3_scale.train.resume import resume_manifest

    out, remote = tmp_path / "run", tmp_path / "mirror"

    def manifest(url: str, *overrides: str) -> dict | None:
        cfg = resolve_config(
            None,
            ["--out_dir", str(out), "--checkpoint.remote_url", url, "--train.max_steps", "100", *overrides],
        )
        return resume_manifest(cfg)

    assert manifest(remote.as_uri()) is None  # nothing there yet: a fresh start
    _committed(remote, 30, 2.0)
    _committed(remote, 50, 4.0)
    (remote / "step-00000070").mkdir()  # never committed
    (remote / "step-00000090").mkdir()
    (remote / "step-00000090" / "manifest.json").write_text('{"format": ')  # damaged
    assert manifest(remote.as_uri())["step"] == 50  # the newest committed one
    (remote / "latest").write_text("step-00000030\n")
    found = manifest(remote.as_uri())
    assert (found["step"], found["cost_usd"]) == (
        30,
        2.0,
    )  # the remote pointer's target first, as it downloads
    assert manifest(remote.as_uri(), "--train.resume", "never") is None
    assert manifest((tmp_path / "nowhere").as_uri()) is None  # no store there: the resume says why, not this
    _committed(out / "checkpoints", 10, 0.5)
    assert manifest(remote.as_uri())["step"] == 10  # a local checkpoint comes first, as for the resume


def test_a_resumed_forecast_counts_only_the_pauses_after_its_start() -> None:
    from gaudi3_scale.forecast.wall import pause_count as _count

    assert _count(0, 100, 25) == 4  # 25, 50, 75, 100
    assert _count(40, 100, 25) == 3  # 50, 75, 100
    assert _count(40, 110, 25) == 4  # 50, 75, 100 and the last step
    assert _count(40, 100, 0) == 1  # only after the last step
