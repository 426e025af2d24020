"""`gaudi3 tune` with real trials: each one a short `gaudi3 train` run in its own process group."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from process_groups import kill_what_is_left, wait_for_job_group

pytestmark = pytest.mark.integration

# Trials as short as a measurement can be: 1 unmeasured + 1 measured step, one thread per rank.
SHORT = ["--warmup-steps", "1", "--measure-steps", "1", "--compile", "off", "--threads", "1"]


def _gaudi3(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """Global batch 128 under a 0.5 GiB budget: micro-batch 128 needs ~0.75 GiB RSS here, 8 about 0.43 GiB.

    Estimate pruning is off, so the bisection meets real out-of-memory trials (the RSS watcher kills them).
    """
    out = tmp_path_factory.mktemp("tune") / "run"
    args = ["tune", "--global-batch", "128", "--memory-budget", "0.5GiB", "--no-estimate-pruning", "--precisions",
            "32-true"]  # fmt: skip
    proc = _gaudi3(*args, "--activation-checkpointing", "off", *SHORT, "--out", str(out))
    return out, proc


def _report(out: Path) -> dict[str, Any]:
    return json.loads((out / "tune.json").read_text())


def test_out_of_memory_trials_are_recorded_and_the_search_continues_below_them(
    tuned: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, proc = tuned
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = _report(out)
    trials = {t["candidate"]["micro_batch_size"]: t for t in report["trials"]}
    assert trials[128]["status"] == "oom" and "memory budget exceeded" in trials[128]["reason"]
    best = report["best"]
    assert best["status"] == "ok" and best["candidate"]["micro_batch_size"] < 128
    assert best["peak_memory_bytes"] <= 0.5 * 2**30
    ok = [t for t in report["trials"] if t["status"] == "ok"]
    # the search's incumbent: no trial measured min_gain faster than it (a smaller gain is noise)
    assert all(t["tokens_per_s"] < best["tokens_per_s"] * (1 + report["min_gain"]) for t in ok)
    assert len(ok) >= 1 and report["trials_run"] < report["grid_size"]
    # The bisection never ran a micro-batch above one that ran out of memory... and recorded why each ended.
    smallest_oom = min(m for m, t in trials.items() if t["status"] == "oom")
    assert all(m < smallest_oom for m, t in trials.items() if t["status"] == "ok")
    assert all(t["reason"] for t in report["trials"])
    assert "limited by memory: micro-batch" in proc.stdout or "limited by throughput plateau" in proc.stdout


def test_ok_trials_feed_the_calibration_store_and_failed_ones_do_not(
    tuned: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """Each ok trial is a probe of its layout for this machine's store (forecast.feed); an out-of-memory one is a
    note, never a probe."""
    out, proc = tuned
    trials = [t for t in _report(out)["trials"] if t["status"] in ("ok", "oom")]
    fed = proc.stdout.count("calibration store: probe of this layout stored")
    refused = proc.stdout.count("calibration store: not fed (oom: a run that failed or ran out of memory")
    assert fed == sum(t["status"] == "ok" for t in trials) and refused == len(trials) - fed >= 1
    (store,) = (Path(os.environ["GAUDI3_CACHE"]) / "calibration").glob("*.json")
    origins = {p["origin"] for p in json.loads(store.read_text())["probes"].values()}
    ok_keys = {t["key"] for t in trials if t["status"] == "ok"}
    assert {f"tune trial {out}/trials/{key}" for key in ok_keys} <= origins
    assert not any(f"tune trial {out}/trials/{t['key']}" in origins for t in trials if t["status"] == "oom")


def test_reports_agree_with_each_other(tuned: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, proc = tuned
    report = _report(out)
    with (out / "trials.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(report["trials"])
    for row, trial in zip(rows, report["trials"], strict=True):
        assert row["status"] == trial["status"]
        assert int(row["micro_batch_size"]) == trial["candidate"]["micro_batch_size"]
        assert int(row["accumulation"]) == 128 // trial["candidate"]["micro_batch_size"]
        if trial["tokens_per_s"]:
            assert float(row["tokens_per_s"]) == pytest.approx(trial["tokens_per_s"])
    assert rows[0]["rank"] == "1" and rows[0]["status"] == "ok"
    mb = report["best"]["candidate"]["micro_batch_size"]
    label = f"mb {mb}×{128 // mb}"
    assert f"best: auto 32-true gb 128 {label}" in proc.stdout


def test_the_winner_yaml_trains_and_a_rerun_comes_from_the_cache(
    tuned: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    out, _ = tuned
    best = _report(out)["best"]["candidate"]
    written = yaml.safe_load((out / "best.yaml").read_text())
    assert written["train"]["micro_batch_size"] == best["micro_batch_size"]
    assert written["train"]["global_batch_size"] == 128 and written["train"]["threads"] == 1
    # The config's global batch is 12 sequences; 128 is k = 128/12 times larger: lr × √k (the default rule).
    assert written["optim"]["lr"] == pytest.approx(1e-3 * (128 / 12) ** 0.5)
    assert written["optim"]["warmup_steps"] == 10  # ceil(100 / k): the same warmup tokens
    run = _gaudi3("train", "--config", str(out / "best.yaml"), "--out", str(tmp_path / "train"), "--no-progress",
                  "--sample-tokens", "0", "--train.max_steps", "2", "--train.val_batches", "1")  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    assert summary["steps"] == 2
    args = ["tune", "--global-batch", "128", "--memory-budget", "0.5GiB", "--no-estimate-pruning", "--precisions",
            "32-true"]  # fmt: skip
    again = _gaudi3(*args, "--activation-checkpointing", "off", *SHORT, "--out", str(out))
    assert again.returncode == 0, again.stdout + again.stderr
    report = _report(out)
    assert report["trials_run"] == 0 and report["trials_cached"] >= 2
    assert report["best"]["candidate"] == best


def test_a_whole_strategy_failing_does_not_stop_the_tuner(tmp_path: Path) -> None:
    """DeepSpeed made unimportable in the trials (as on a machine without it working): every deepspeed trial
    crashes; the tuner records that, gives the strategy up, and still picks a winner among the others."""
    shim = tmp_path / "shim" / "deepspeed"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(
        'raise ImportError("deepspeed is broken on this machine (test shim)")\n'
    )
    env = {**os.environ, "PYTHONPATH": str(shim.parent)}
    out = tmp_path / "tune"
    proc = _gaudi3("tune", "--world-size", "2", "--strategies", "ddp,deepspeed_zero2", "--global-batch", "2",
                   "--precisions", "32-true",
                   "--activation-checkpointing", "off", *SHORT, "--model.num_layers", "2", "--out", str(out),
                   env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = _report(out)
    by_strategy = {t["candidate"]["strategy"]: t for t in report["trials"]}
    assert by_strategy["deepspeed_zero2"]["status"] == "crash"
    assert "deepspeed" in by_strategy["deepspeed_zero2"]["reason"]
    assert by_strategy["ddp"]["status"] == "ok" and report["best"]["candidate"]["strategy"] == "ddp"
    assert any("deepspeed_zero2" in note and "given up" in note for note in report["notes"])
    assert report["best"]["candidate"]["micro_batch_size"] == 1


def test_a_pipeline_layout_is_a_trial_of_its_own(tmp_path: Path) -> None:
    """On 2 ranks a Llama's FSDP group and its pipeline group (PP 2, 1F1B) each run a real trial; the pipeline's
    trial trains through the pipeline (its run config and its 2 micro-batches a step), the reports name its
    layout, and best.yaml keeps the winner's."""
    out = tmp_path / "tune"
    # one kv head: no tensor parallel, so the groups are FSDP over 2 ranks and one pipeline of 2
    proc = _gaudi3("tune", "--world-size", "2", "--strategies", "fsdp", "--global-batch", "2", "--precisions",
                   "32-true", "--activation-checkpointing", "off", *SHORT, "--model.name", "llama-tiny",
                   "--model.num_kv_heads", "1", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = _report(out)
    assert "pipeline (1F1B) 1/2" in report["space"]
    trials = {t["candidate"]["pp_size"]: t for t in report["trials"]}
    assert sorted(trials) == [1, 2] and all(t["status"] == "ok" for t in trials.values()), trials
    pipeline = trials[2]
    run = yaml.safe_load((out / "trials" / pipeline["key"] / "run" / "config.yaml").read_text())
    assert (run["parallel"]["pp_size"], run["parallel"]["pp_schedule"], run["train"]["micro_batch_size"]) == (
        2, "1f1b", 1)  # fmt: skip
    assert pipeline["tokens_per_s"] > 0 and pipeline["measured_steps"] == [2]
    with (out / "trials.csv").open() as f:
        rows = {row["pp_size"]: row for row in csv.DictReader(f)}
    assert rows["2"]["accumulation"] == "2" and rows["1"]["accumulation"] == "1"
    assert "fsdp pp 2 32-true gb 2 mb 1×2" in proc.stdout
    best = yaml.safe_load((out / "best.yaml").read_text())
    assert best["parallel"]["pp_size"] == report["best"]["candidate"]["pp_size"]
    if best["parallel"]["pp_size"] == 2:  # micro-batch 1 is the whole share of an FSDP rank, not a pipeline's
        assert report["limit"].startswith(
            "search space: micro-batch 1 is the largest that leaves the pipeline"
        )
    else:
        assert report["limit"].startswith("search space: micro-batch 1 is the whole per-rank batch")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--memory-budget", "1MiB"], "--memory-budget 0.00 GiB per rank cannot hold any configuration"),
        (["--memory-budget", "plenty"], "--memory-budget: cannot read 'plenty'"),
        (["--world-size", "5"], "global batch 12 sequences cannot be split over 5 ranks"),
        (["--global-batch", "12,x"], "--global-batch: expected comma-separated whole numbers"),
        (["--strategies", "zero9", "--world-size", "2"], "--strategies: zero9 not available with 2 rank(s)"),
        (["--pipeline", "on", "--world-size", "2"], "--pipeline on: no pipeline layout in this search"),
        # a flag given but empty is not "every value": it would start the whole search by mistake
        (["--precisions", ","], "--precisions: empty; allowed: 32-true"),
        (["--strategies", " , ", "--world-size", "2"], "--strategies: empty; allowed: ddp"),
        (["--global-batch", ","], "--global-batch: empty; allowed: multiples of the world size (1)"),
        (["--threads", ","], "--threads: empty; allowed: CPU threads per rank"),
        # a winner no candidate of the global batch could write (light checkpoints are single-file, fsdp's sharded):
        # refused before any trial, not after the whole search
        (
            ["--strategies", "fsdp", "--world-size", "2", "--checkpoint.light_every_steps", "3"],
            "global batch 12: the winner's config would be refused: checkpoint.light_every_steps: light checkpoints "
            "are one file written by rank 0, but parallel.strategy fsdp saves sharded checkpoints",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    gaudi3_cli: Callable[..., tuple[int, str, str]], tmp_path: Path, args: list[str], message: str
) -> None:
    code, out, err = gaudi3_cli("tune", *args, "--out", str(tmp_path / "t"))
    assert code == 2, out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "t" / "trials.jsonl").exists()


def test_a_hanging_trial_is_killed_and_nothing_fitting_exits_1(tmp_path: Path) -> None:
    out = tmp_path / "tune"
    proc = _gaudi3(
        "tune", "--trial-timeout-s", "2", "--activation-checkpointing", "off", "--precisions", "32-true", *SHORT,
        "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = _report(out)
    (trial,) = [t for t in report["trials"] if t["status"] != "pruned"]
    assert trial["status"] == "timeout" and "no result within 2 s" in trial["reason"]
    assert trial["wall_s"] < 10  # killed, process group and all
    assert report["best"] is None and not (out / "best.yaml").exists()
    assert "limited by failures: no trial finished (1 timeout)" in proc.stdout


def _processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and text in " ".join(proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def test_a_timed_out_trial_with_a_hung_rank_leaves_no_rank_running(tmp_path: Path) -> None:
    """torch's launcher starts each rank in a session of its own, out of the trial's process group; a rank hung in
    its step takes the parent-death SIGTERM as "stop after this step", which never comes. The timeout still ends
    every process of the trial. The timeout leaves the ranks time to reach their first step (~7 s here)."""
    out = tmp_path / "tune"
    env = {**os.environ, "GAUDI3_INJECT_FAULTS": "sleep:rank=1:step=0:seconds=600"}
    proc = _gaudi3("tune", "--world-size", "2", "--strategies", "ddp", "--global-batch", "2", "--trial-timeout-s",
                   "15", "--precisions", "32-true", "--activation-checkpointing", "off", "--pipeline", "off", *SHORT,
                   "--model.num_layers", "1", "--out", str(out), env=env)  # fmt: skip
    left = _processes_mentioning(str(out))
    for orphan in left:
        orphan.kill()
    assert left == [], f"the trial's processes outlived it: {left}"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (trial,) = [t for t in _report(out)["trials"] if t["status"] != "pruned"]
    assert trial["status"] == "timeout" and "no result within 15 s" in trial["reason"], trial


def test_trials_are_ranked_by_synchronised_time(tmp_path: Path) -> None:
    """On a fake asynchronous device (tests/assets/fake_device_site) micro-batch 4 takes 150 ms of device time per
    forward, 2 takes 5 ms and 1 takes 20 ms, while the host needs about as long for each: a host clock would pick
    micro-batch 4 (fewest launches). Timed after a synchronise, micro-batch 4 is the slowest and 2 wins (1 runs four
    forwards of 20 ms: a clear margin, so one measured step cannot flip the order)."""
    site = Path(__file__).resolve().parents[1] / "assets" / "fake_device_site"
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "FAKE_DEVICE_S_BY_BATCH": "4:0.15,2:0.005,1:0.02"}  # fmt: skip
    out = tmp_path / "tune"
    proc = _gaudi3("tune", "--global-batch", "4", "--precisions", "32-true", "--activation-checkpointing", "off",
                   *SHORT, "--model.num_layers", "1", "--out", str(out), env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = _report(out)
    trials = {t["candidate"]["micro_batch_size"]: t for t in report["trials"] if t["status"] == "ok"}
    assert trials[4]["step_time_s"] >= 0.95 * 0.15, trials[4]
    assert report["best"]["candidate"]["micro_batch_size"] == 2, report["trials"]


def test_ctrl_c_stops_the_running_trial_and_its_whole_process_group(tmp_path: Path) -> None:
    """A trial runs in a session of its own, so a terminal's Ctrl-C reaches only the tuner: the tuner stops the
    trial's process group before it exits, and no training outlives it. Sent as soon as the trial has started:
    what is under test is the supervisor, not how far the trial got."""
    out = tmp_path / "tune"
    tuner = subprocess.Popen(
        [sys.executable, "-m", "gaudi3_scale.cli", "tune", "--global-batch", "1", "--precisions", "32-true",
         "--activation-checkpointing", "off", "--pipeline", "off", *SHORT, "--measure-steps", "1000",
         "--model.num_layers", "1", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal starts it
    )  # fmt: skip
    try:
        trial = wait_for_job_group(tuner.pid)
        tuner.send_signal(signal.SIGINT)
        stdout, stderr = tuner.communicate(timeout=120)
    finally:
        tuner.kill()
    # interrupted, not bad input (2): 128 + SIGINT, as a shell reports it (docs/reference/exit_codes.md)
    assert tuner.returncode == 130 and stderr.endswith("gaudi3: interrupted\n"), stdout + stderr
    assert kill_what_is_left(trial) == [], "the trial outlived the tuner"
    # a stopped trial is no result: nothing recorded, no report
    assert not (out / "tune.json").exists() and not (out / "trials.jsonl").exists()
