"""`gaudi3 plan` as users run it (a subprocess, the default config): a forecast with a source for every number,
written as JSON; the CPU peak measured once and kept, raised by each run's own measurement; a probe stored and used by later forecasts of the same layout;
a catalog machine's scale-out; bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

KINDS = ("measured", "catalog", "model", "assumption")


def _plan(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GAUDI3_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "plan", *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path)  # fmt: skip


def _figures(forecast: dict[str, Any]) -> list[dict[str, Any]]:
    groups = [forecast[g] for g in ("memory", "step", "wall")]
    return [f for g in groups for f in g.values()] + [
        forecast[k] for k in ("tokens_per_s", "energy_kwh", "cost_usd")
    ]


def _store(tmp_path: Path) -> dict[str, Any]:
    (path,) = (tmp_path / "cache" / "calibration").glob("*.json")
    return dict(json.loads(path.read_text()))


def test_a_forecast_says_where_every_number_comes_from_and_keeps_the_peak(tmp_path: Path) -> None:
    done = _plan(tmp_path, "--out", "p.json")
    assert done.returncode == 0, done.stderr
    forecast = json.loads((tmp_path / "p.json").read_text())
    assert all(f["source"].split(":")[0] in KINDS for f in _figures(forecast))
    assert forecast["run"]["probed"] is False and forecast["run"]["world_size"] == 1
    parts = [v["value"] for k, v in forecast["memory"].items() if k != "total_bytes"]
    assert forecast["memory"]["total_bytes"]["value"] == pytest.approx(sum(parts))
    wall = forecast["wall"]
    assert wall["wall_s"]["value"] == pytest.approx(sum(v["value"] for k, v in wall.items() if k != "wall_s"))
    assert forecast["predicted_step_time_s"] == forecast["step"]["step_time_s"]["value"] > 0
    assert "MFU 0.400: assumption" in forecast["step"]["compute_s"]["source"]  # no probe yet: said so
    assert "wrote p.json" in done.stdout and "per-rank peak memory:" in done.stdout
    (peak,) = _store(tmp_path)["peaks"].values()
    assert _plan(tmp_path, "--out", "p2.json").returncode == 0
    assert list(_store(tmp_path)["peaks"].values()) == [peak]  # measured once, then read
    assert _plan(tmp_path, "--out", "p3.json", "--refresh-peak").returncode == 0
    assert next(iter(_store(tmp_path)["peaks"].values()))["measured_unix_s"] > peak["measured_unix_s"]


def _seed_peak(tmp_path: Path, flops: float) -> str:
    """This machine's store with its default-threads peak set to `flops`; the slot's name."""
    from gaudi3_scale.device.select import cpu_model_name, cpu_threads_per_rank, usable_cpu_cores
    from gaudi3_scale.forecast.calibration import CalibrationStore, machine_key

    key = machine_key(cpu_model_name(), usable_cpu_cores())
    slot = f"cpu-{cpu_threads_per_rank(1)}-threads"
    CalibrationStore.for_machine(key, cache_dir=tmp_path / "cache").set_peak(slot, flops)
    return slot


def _forecast_of_run(tmp_path: Path, out: str) -> dict[str, Any]:
    """`gaudi3 train` of 2 steps as users run it; the forecast it recorded at its start (<run>/plan.json)."""
    done = _train(tmp_path, out, "--train.max_steps", "2", "--model.num_layers", "1")
    assert done.returncode == 0, done.stderr
    return dict(json.loads((tmp_path / out / "plan.json").read_text()))


def test_a_busy_machines_peak_is_raised_by_the_next_run_and_never_lowered(tmp_path: Path) -> None:
    """The store keeps the best of its measurements: a peak first measured while the machine was busy (here 1
    MFLOP/s) would time every later forecast of this CPU far too slow. Each `gaudi3 train` measures it again (the
    trainer's own measurement) and keeps it when higher; a higher stored one stays."""
    slot = _seed_peak(tmp_path, 1e6)
    forecast = _forecast_of_run(tmp_path, "run-a")
    raised = _store(tmp_path)["peaks"][slot]["flops"]
    assert raised > 1e9  # any CPU multiplies 1024² matrices faster than 1 GFLOP/s
    assert f"measured peak {raised / 1e12:.3g} TFLOP/s" in forecast["step"]["compute_s"]["source"]
    _seed_peak(tmp_path, 1e15)  # above this CPU's: a measurement now is lower, and is not kept
    forecast = _forecast_of_run(tmp_path, "run-b")
    assert _store(tmp_path)["peaks"][slot]["flops"] == 1e15
    assert "measured peak 1e+03 TFLOP/s" in forecast["step"]["compute_s"]["source"]


def test_a_forecast_of_other_threads_per_rank_is_timed_at_their_peak(tmp_path: Path) -> None:
    """`--train.threads` other than the default: the compute time is over that thread count's stored peak (here
    seeded, so nothing is measured), and the store gains no other slot."""
    from gaudi3_scale.device.select import cpu_model_name, cpu_threads_per_rank, usable_cpu_cores
    from gaudi3_scale.forecast.calibration import CalibrationStore, machine_key

    default = cpu_threads_per_rank(1)
    other = 1 if default > 1 else 2  # a thread count the run does not get by default
    key = machine_key(cpu_model_name(), usable_cpu_cores())
    store = CalibrationStore.for_machine(key, cache_dir=tmp_path / "cache")
    store.set_peak(f"cpu-{default}-threads", 4e10)
    store.set_peak(f"cpu-{other}-threads", 1e10)
    args = ("--train.device", "cpu", "--model.num_layers", "1")
    assert _plan(tmp_path, "--out", "default.json", *args).returncode == 0
    done = _plan(tmp_path, "--out", "other.json", *args, "--train.threads", str(other))
    assert done.returncode == 0, done.stderr
    by_default, at_other = (json.loads((tmp_path / f).read_text()) for f in ("default.json", "other.json"))
    assert at_other["run"]["layout"]["threads"] == other
    assert "measured peak 0.01 TFLOP/s" in at_other["step"]["compute_s"]["source"]
    compute = [f["step"]["compute_s"]["value"] for f in (at_other, by_default)]
    assert compute[0] / compute[1] == pytest.approx(4.0)
    assert sorted(_store(tmp_path)["peaks"]) == sorted({f"cpu-{default}-threads", f"cpu-{other}-threads"})


def test_a_probe_is_stored_and_later_forecasts_of_its_layout_use_it(tmp_path: Path) -> None:
    remote = tmp_path / "remote"  # the run's mirror: the probe, a throwaway run, must not upload into it
    args = (
        "--train.max_steps",
        "300",
        "--train.val_batches",
        "2",
        "--checkpoint.remote_url",
        f"file://{remote}",
    )
    done = _plan(tmp_path, "--probe", "--out", "probed.json", *args)
    assert done.returncode == 0, done.stderr
    assert not remote.exists()
    probed = json.loads((tmp_path / "probed.json").read_text())
    (probe,) = _store(tmp_path)["probes"].values()
    assert probed["run"]["probed"] is True and probe["key"] == probed["run"]["probe_key"]
    assert probed["predicted_step_time_s"] == probe["step_time_s"] > 0
    assert probed["memory"]["total_bytes"]["value"] == probe["peak_memory_bytes"]
    assert probed["step"]["step_time_s"]["source"].startswith("measured: probe of this layout")
    later = _plan(tmp_path, "--out", "later.json", *args)  # no --probe: the store's probe of this layout
    assert json.loads((tmp_path / "later.json").read_text())["predicted_step_time_s"] == probe["step_time_s"]
    other = _plan(tmp_path, "--out", "other.json", "--train.micro_batch_size", "6", *args)  # another layout
    other_forecast = json.loads((tmp_path / "other.json").read_text())
    assert other_forecast["run"]["probed"] is False
    assert (
        "median achieved ÷ peak of 1 probe(s) on this machine"
        in other_forecast["step"]["compute_s"]["source"]
    )
    assert later.returncode == other.returncode == 0


def test_a_catalog_machine_splits_the_step_into_compute_and_communication(tmp_path: Path) -> None:
    done = _plan(tmp_path, "--machine", "h100", "--nodes", "2", "--model.name", "llama3-8b", "--data.tokenizer",
                 "gpt2", "--parallel.strategy", "fsdp", "--train.global_batch_size", "64", "--out", "h.json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    forecast = json.loads((tmp_path / "h.json").read_text())
    assert forecast["run"]["world_size"] == 16 and forecast["run"]["machine"] == "h100-sxm"
    assert "8 ranks sharing a node's" in forecast["step"]["communication_s"]["source"]
    assert "3,200 Gbps" in forecast["step"]["communication_s"]["source"]
    assert forecast["energy_kwh"]["value"] > 0 and "TDP" in forecast["energy_kwh"]["source"]


def test_a_catalog_machine_lends_its_node_to_the_config_and_the_scale_out_table_adds_up(
    tmp_path: Path,
) -> None:
    """Tensor parallel 2 fits a Gaudi 3 node of 8 (not this machine's one process); the docs' scale-out table
    (benchmarks/plan_scale_out.py) is the forecast's own split, with sourced links for both machines."""
    done = _plan(tmp_path, "--machine", "gaudi3", "--nodes", "2", "--model.name", "llama3-70b", "--data.tokenizer",
                 "gpt2", "--parallel.strategy", "fsdp", "--parallel.tp_size", "2", "--train.global_batch_size",
                 "64", "--out", "g.json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    forecast = json.loads((tmp_path / "g.json").read_text())
    assert forecast["run"]["world_size"] == 16 and forecast["run"]["layout"]["tp_size"] == 2
    assert "Intel Gaudi Network Configuration" in forecast["step"]["communication_s"]["source"]
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_scale_out.py"
    env = {**os.environ, "GAUDI3_CACHE": str(tmp_path / "cache")}
    ran = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "s.json"), "--docs-image",
                          str(tmp_path / "s-docs.png")], capture_output=True, text=True, env=env)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert {(r["model"], r["machine"], r["nodes"]) for r in rows} == {
        (m, k, n) for m in ("llama3-8b", "llama3-70b") for k in ("h100", "gaudi3") for n in (8, 16, 64)
    } | {("llama3-405b", k, n) for k in ("h100", "gaudi3") for n in (16, 32, 64)}
    # the pipelined 405B rows carry the forecast's bubble, the others none
    assert all((r["bubble_s"] > 0) == (r["model"] == "llama3-405b") for r in rows)
    for row in rows:
        assert row["step_time_s"] == pytest.approx(
            row["compute_s"] + row["communication_s"] + row["bubble_s"]
        )
        assert (
            row["usd_per_1e12_tokens"] is None
            if row["machine"] == "gaudi3"
            else row["usd_per_1e12_tokens"] > 0
        )
    assert (tmp_path / "s.png").stat().st_size > 0 and (tmp_path / "s-docs.png").stat().st_size > 0


def test_llama3_405b_under_a_pipeline_reports_its_bubble(tmp_path: Path) -> None:
    """16 nodes of 8 H100: tensor parallel 8 × pipeline parallel 8 (the Llama 3 split of 126 layers) × FSDP 2; the
    step's bubble is the 1F1B formula's share of it, the memory that of the busiest pipeline rank."""
    done = _plan(tmp_path, "--machine", "h100", "--nodes", "16", "--model.name", "llama3-405b", "--data.tokenizer",
                 "gpt2", "--parallel.pp_size", "8", "--parallel.pp_split", "[15,31,47,63,79,95,111]",
                 "--parallel.tp_size", "8", "--parallel.activation_checkpointing", "true",
                 "--train.global_batch_size", "256", "--train.micro_batch_size", "1", "--out", "p.json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "bubble" in done.stdout
    forecast = json.loads((tmp_path / "p.json").read_text())
    step = {k: v["value"] for k, v in forecast["step"].items()}
    m, p = 128, 8  # 256 sequences over 2 data-parallel pipelines of micro-batch 1
    assert forecast["run"]["layout"]["accumulation"] == m and forecast["run"]["layout"]["pp_size"] == p
    bubble = (p - 1) / (m + p - 1)  # of the step; the busiest rank computes the rest
    assert step["bubble_s"] == pytest.approx(step["compute_s"] * bubble / (1 - bubble))
    assert step["step_time_s"] == pytest.approx(
        step["compute_s"] + step["communication_s"] + step["bubble_s"]
    )
    assert "(p − 1)/(m + p − 1)" in forecast["step"]["bubble_s"]["source"]
    assert "pipeline point-to-point" in forecast["step"]["communication_s"]["source"]
    memory = forecast["memory"]["total_bytes"]["source"]
    assert "steady state" in memory and "pipeline rank " in memory and "of 8, the largest" in memory


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--machine", "tpu9"], "--machine: unknown machine kind 'tpu9'; allowed: cpu,"),
        (["--nodes", "2"], "--nodes: only with --machine"),
        (["--machine", "h100", "--probe"], "--probe: runs on this machine"),
        (["--compare", "."], "--out: not with --compare"),  # every case writes --out never.json
        (["--parallel.tp_size", "3"], "tp_size"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_with_nothing_written(
    tmp_path: Path, args: list[str], message: str
) -> None:
    done = _plan(tmp_path, *args, "--out", "never.json")
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "never.json").exists()


def _train(
    tmp_path: Path, out: str, *args: str, cache: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GAUDI3_CACHE": str(cache or tmp_path / "cache")}
    command = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", out, "--sample-tokens", "0",
               "--no-progress", "--train.max_steps", "20", "--train.val_every_steps", "0", *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)


def test_a_run_reports_its_forecast_beside_its_measurements_and_plan_compares_them(tmp_path: Path) -> None:
    done = _train(tmp_path, "run")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    for key in ("step_time_s", "wall_s", "peak_memory_bytes", "tokens_per_s"):
        assert summary[f"predicted_{key}"] == plan[f"predicted_{key}"] and summary[key] > 0
    assert plan["run"]["max_steps"] == 20  # the run's own config, overrides included
    compared = _plan(tmp_path, "--compare", "run")
    assert compared.returncode == 0, compared.stderr
    lines = {line.split()[0]: line for line in compared.stdout.splitlines() if line.strip()}
    error = summary["predicted_step_time_s"] / summary["step_time_s"] - 1
    assert (
        f"{error:+.1%}" in lines["step_time_s"]
        and "the step time was predicted from: model:" in compared.stdout
    )
    # run again, it trains nothing: the run's forecast and summary stay, and so does what --compare says of them
    kept = {name: (tmp_path / "run" / name).read_bytes() for name in ("plan.json", "summary.json")}
    again = _train(tmp_path, "run")
    assert again.returncode == 0, again.stderr
    assert {name: (tmp_path / "run" / name).read_bytes() for name in kept} == kept
    assert _plan(tmp_path, "--compare", "run").stdout == compared.stdout
    # a summary without predictions (an older run) is one line and exit 2
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text(json.dumps({k: v for k, v in summary.items()
                                                                if not k.startswith("predicted_")}))  # fmt: skip
    old = _plan(tmp_path, "--compare", "old")
    assert old.returncode == 2 and "has no predicted_* fields" in old.stderr


def test_a_forecast_that_fails_never_stops_the_run(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "calibration").write_text(
        "a file where the calibration store's directory goes: it cannot be written"
    )
    done = _train(tmp_path, "run", cache=cache)
    assert done.returncode == 0, done.stderr
    assert "gaudi3: note: no forecast for this run" in done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "predicted_step_time_s" not in summary and not (tmp_path / "run" / "plan.json").exists()


def test_a_run_in_epochs_records_the_forecast_of_the_steps_it_trains(tmp_path: Path) -> None:
    """`gaudi3 train --train.max_epochs 1`: the forecast it records at its start (plan.json, the summary's
    predicted_* fields) is of the steps the epoch resolves to, not of the max_steps placeholder (2,000)."""
    text = tmp_path / "corpus.txt"
    # 8,200 characters: a few steps an epoch
    text.write_text("to be or not to be, that is the question\n" * 200)
    env = {**os.environ, "GAUDI3_CACHE": str(tmp_path / "cache")}
    args = ("--out", "run", "--sample-tokens", "0", "--no-progress", "--data.source", str(text), "--model.num_layers",
            "1", "--train.max_epochs", "1", "--train.val_every_steps", "0", "--train.val_batches", "1")  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "train", *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    forecast = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert 1 < summary["steps"] < 100
    assert forecast["run"]["max_steps"] == summary["steps"]
    assert summary["predicted_wall_s"] == forecast["predicted_wall_s"]


def test_max_epochs_is_forecast_as_the_steps_train_would_run(tmp_path: Path) -> None:
    """`gaudi3 train` turns train.max_epochs into steps over the dataset's tokens; the forecast covers as many."""
    from gaudi3_scale.cli.main import main

    steps = {}
    for epochs in (1, 3):
        main(
            [
                "plan",
                "--model.num_layers",
                "1",
                "--train.max_epochs",
                str(epochs),
                "--out",
                str(tmp_path / "p.json"),
            ]
        )
        steps[epochs] = json.loads((tmp_path / "p.json").read_text())["run"]["max_steps"]
    tokens_per_step = 12 * 64  # the default global batch × context
    assert steps[1] == math.ceil(1_003_854 / tokens_per_step)  # the bundled corpus's training tokens
    assert steps[3] == math.ceil(3 * 1_003_854 / tokens_per_step)
