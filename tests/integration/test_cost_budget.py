"""Live cost on real (tiny) CPU runs: a budget stops the run with a checkpoint and exit 3, the accrued cost rides in
the checkpoint so a resumed run continues the sum, and the spot policy pauses a run (exit 4) from a test-controlled
price source without a failing one ever stopping training.

Prices are set so that $1 is one second of wall time (3600 USD/h on one node)."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.metering.spot import SpotPriceError, SpotQuote, register_spot_provider
from gaudi3_scale.train import GaudiTrainer, build_run_config

pytestmark = pytest.mark.integration

CliResult = tuple[int, str, str]
TINY = ["--train.threads", "2", "--model.num_layers", "1", "--train.val_every_steps", "0",
        "--train.log_every_steps", "1", "--optim.warmup_steps", "2"]  # fmt: skip
STOP_LINE = re.compile(
    r"^budget reached: \$(\d+\.\d+) accrued of the \$(\d+\.\d+) budget \(cost\.budget_usd\) after step (\d+); "
    r"checkpoint committed; exit 3 — raise cost\.budget_usd to continue$"
)


class _FixedSpotPrice:
    """A price source the test controls: every node costs `usd_per_hour` on the spot market."""

    name = "test-fixed"
    usd_per_hour = 50.0

    def __init__(self, **kwargs: Any) -> None:
        pass

    def fetch(self, instance_type: str, region: str) -> SpotQuote:
        return SpotQuote(usd_per_hour=self.usd_per_hour, instance_type=instance_type, region=region,
                         availability_zone=f"{region}a", provider=self.name, fetched_at_unix=time.time())  # fmt: skip


class _BrokenSpotPrice:
    name = "test-broken"

    def __init__(self, **kwargs: Any) -> None:
        pass

    def fetch(self, instance_type: str, region: str) -> SpotQuote:
        raise SpotPriceError("test-broken: the price API is down")


register_spot_provider("test-fixed", _FixedSpotPrice)
register_spot_provider("test-broken", _BrokenSpotPrice)


def _train(gaudi3_cli: Callable[..., CliResult], out: Path, *args: str) -> CliResult:
    return gaudi3_cli("train", "--out", str(out), "--sample-tokens", "0", "--no-progress", *TINY, *args)


def _cost_records(out: Path) -> list[dict[str, Any]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "cost_usd" in r]


def _files(directory: Path) -> dict[Path, tuple[str, int]]:
    """Every file with its SHA-256 and modification time (ns); not the run-directory lock, which each run that
    holds the directory (a refused resume included) stamps with its pid (train.run_lock)."""
    return {p: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != ".run.lock"}  # fmt: skip


def _stored_cost(checkpoint: Path) -> float:
    """The accrued cost inside the checkpoint, and the same in its manifest."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    state = checkpoint / "state.ckpt"
    meta = torch.load(state if state.is_file() else checkpoint / "meta.pt", weights_only=True)["gaudi3_meta"]
    assert meta["cost_usd"] == manifest["cost_usd"]
    return float(manifest["cost_usd"])


def _check_budget_stop(out: Path, result: CliResult, budget_usd: float) -> dict[str, Any]:
    code, _stdout, stderr = result
    assert code == 3, stderr
    match = STOP_LINE.match(stderr.strip().splitlines()[-1])
    assert match, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_exit_code"] == 3 and summary["stop_signal"] is None and summary["interrupted"]
    assert summary["cost_budget_usd"] == budget_usd and summary["cost_usd"] >= budget_usd
    assert int(match.group(3)) == summary["steps"] and float(match.group(2)) == budget_usd
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint.name == f"step-{summary['steps']:08d}"
    assert (out / "checkpoints" / "latest").read_text().strip() == checkpoint.name
    assert _stored_cost(checkpoint) == summary["cost_usd"]
    return summary


def test_budget_stop_then_resume_continues_the_sum_and_stops_again(
    tmp_path: Path, gaudi3_cli: Callable[..., CliResult]
) -> None:
    out = tmp_path / "run"
    common = [
        "--train.max_steps",
        "2000",
        "--checkpoint.every_steps",
        "0",
        "--cost.price_usd_per_hour",
        "3600",
    ]
    first = _check_budget_stop(out, _train(gaudi3_cli, out, *common, "--cost.budget_usd", "2"), 2.0)
    assert first["steps"] < 2000
    records = _cost_records(out)
    costs = [r["cost_usd"] for r in records]
    assert len(costs) == first["steps"] and costs == sorted(costs) and costs[0] < costs[-1]
    assert costs[-1] == first["cost_usd"] and records[-1]["cost_budget_remaining_usd"] == 0.0
    assert all(r["cost_usd_per_hour"] == 3600.0 and r["cost_budget_usd"] == 2.0 for r in records)
    assert records[0]["cost_projected_usd"] > costs[0] and records[0]["projected_finish_unix"] > time.time()
    assert any(r["cost_budget_warning"] for r in records)

    # Same budget: refused before a step is trained; nothing in the run directory changes.
    before = _files(out)
    code, _stdout, stderr = _train(gaudi3_cli, out, *common, "--cost.budget_usd", "2")
    assert code == 3 and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith("budget reached: $") and f"by checkpoint step-{first['steps']:08d}" in stderr
    assert "nothing trained; exit 3 — raise cost.budget_usd to continue" in stderr
    assert _files(out) == before

    # A higher budget: the sum continues from the checkpoint's value and stops again at the new limit.
    second = _check_budget_stop(out, _train(gaudi3_cli, out, *common, "--cost.budget_usd", "4"), 4.0)
    assert second["steps"] > first["steps"]
    resumed = [r for r in _cost_records(out)[len(records) :]]
    assert resumed[0]["step"] == first["steps"] + 1 and resumed[0]["cost_usd"] > first["cost_usd"]
    assert resumed[-1]["cost_usd"] == second["cost_usd"] and second["cost_usd"] >= 4.0
    assert (Path(first["checkpoint"]) / "manifest.json").is_file()  # keep_last 3: the first stop is kept


def test_budget_survives_the_sharded_checkpoint_path(
    tmp_path: Path, gaudi3_cli: Callable[..., CliResult]
) -> None:
    out = tmp_path / "fsdp"
    common = ["--train.max_steps", "2000", "--checkpoint.every_steps", "0", "--cost.price_usd_per_hour", "3600",
              "--parallel.strategy", "fsdp"]  # fmt: skip
    first = _check_budget_stop(out, _train(gaudi3_cli, out, *common, "--cost.budget_usd", "1"), 1.0)
    assert (Path(first["checkpoint"]) / "meta.pt").is_file()  # DCP layout: shards + meta.pt
    n = len(_cost_records(out))
    second = _check_budget_stop(out, _train(gaudi3_cli, out, *common, "--cost.budget_usd", "2"), 2.0)
    resumed = _cost_records(out)[n:]
    assert resumed[0]["cost_usd"] > first["cost_usd"] and second["cost_usd"] >= 2.0


def test_spot_price_above_the_threshold_pauses_at_the_next_step_boundary(
    tmp_path: Path, gaudi3_cli: Callable[..., CliResult]
) -> None:
    out = tmp_path / "spot"
    code, _stdout, stderr = _train(
        gaudi3_cli, out, "--train.max_steps", "400", "--checkpoint.every_steps", "3",
        "--cost.instance", "aws/p5.48xlarge/us-east-1", "--cost.pricing", "spot",
        "--cost.spot_provider", "test-fixed", "--cost.spot_pause_above_usd_per_hour", "40",
    )  # fmt: skip
    assert code == 4, stderr
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["stop_exit_code"] == 4 and 0 < steps < 400  # at the first step boundary that has the quote
    reason = "spot pause: spot price $50.00/h (p5.48xlarge, us-east-1) is above the pause threshold $40.00/h"
    assert summary["stop_reason"] == f"{reason} (cost.spot_pause_above_usd_per_hour) after step {steps}"
    assert stderr.strip().splitlines()[-1] == (
        f"{summary['stop_reason']}; checkpoint committed; exit 4 — run the same command to resume once the spot "
        "price is lower (or raise cost.spot_pause_above_usd_per_hour)"
    )
    assert "spot policy at step" in stderr and "pause —" in stderr
    assert Path(summary["checkpoint"]).name == f"step-{steps:08d}"
    assert _stored_cost(Path(summary["checkpoint"])) == summary["cost_usd"]
    records = _cost_records(out)
    # until the quote: the catalog's high end, and no price to decide on (continue)
    assert records[-1]["step"] == steps
    assert all(r["cost_usd_per_hour"] == 55.04 and r["spot_decision"] == 0.0 for r in records[:-1])
    assert records[-1]["spot_decision"] == 1.0 and records[-1]["spot_price_usd_per_hour"] == 50.0
    assert records[-1]["cost_usd_per_hour"] == 50.0  # the live quote is the rate from the pause on


def test_a_failing_spot_price_api_never_stops_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = build_run_config(None, parse_overrides([
        "--out_dir", str(tmp_path), *TINY, "--train.max_steps", "6", "--checkpoint.every_steps", "2",
        "--cost.instance", "aws/p5.48xlarge/us-east-1", "--cost.pricing", "spot", "--cost.budget_usd", "1000",
        "--cost.spot_provider", "test-broken", "--cost.spot_pause_above_usd_per_hour", "40",
    ]))  # fmt: skip
    summary = GaudiTrainer(cfg, progress=False).fit()
    assert summary["steps"] == 6 and summary["stop_exit_code"] is None and not summary["interrupted"]
    assert "test-broken: the price API is down (training continues)" in capsys.readouterr().err
    records = _cost_records(tmp_path)
    assert [r["spot_decision"] for r in records if r["step"] % 2 == 0] == [
        0.0,
        0.0,
        0.0,
    ]  # continue: no price
    assert all(r["spot_price_usd_per_hour"] is None and r["cost_usd_per_hour"] == 55.04 for r in records)
    assert 0 < summary["cost_usd"] == _stored_cost(Path(summary["checkpoint"]))


def test_a_budget_without_a_known_price_is_one_line_and_exit_2(
    tmp_path: Path, gaudi3_cli: Callable[..., CliResult]
) -> None:
    for args, needle in [
        (["--cost.budget_usd", "5"], "cost.budget_usd: needs a price to count against"),
        (["--cost.instance", "aws/p5.4xlarge/us-east-1", "--cost.pricing", "spot", "--cost.budget_usd", "5"],
         "cost.price_usd_per_hour: the catalog does not know the spot price of aws/p5.4xlarge/us-east-1"),
    ]:  # fmt: skip
        code, _stdout, stderr = _train(gaudi3_cli, tmp_path / "bad", *args)
        assert code == 2 and len(stderr.strip().splitlines()) == 1 and needle in stderr, stderr
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_two_ranks_agree_on_the_budget_stop_and_the_launcher_exits_3(tmp_path: Path) -> None:
    """Rank 0's clock decides; both ranks stop after the same step, checkpoint, and exit 3; the launcher passes 3
    on with rank 0's one line, no traceback. The resume is refused before any rank starts."""
    out = tmp_path / "ddp"
    args = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--sample-tokens", "0",
            "--no-progress", *TINY, "--nproc-per-node", "2", "--parallel.strategy", "ddp", "--train.threads", "1",
            "--train.max_steps", "2000", "--checkpoint.every_steps", "0", "--cost.price_usd_per_hour", "3600",
            "--cost.budget_usd", "3"]  # fmt: skip
    run = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert run.returncode == 3, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "ChildFailedError" not in run.stderr
    stops = [line for line in run.stderr.splitlines() if "exit 3 — raise cost.budget_usd to continue" in line]
    assert len(stops) == 1 and stops[0].startswith("budget reached: $"), run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_exit_code"] == 3 and summary["cost_usd"] >= 3.0
    assert _stored_cost(Path(summary["checkpoint"])) == summary["cost_usd"]
    before = _files(out)
    again = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 3 and len(again.stderr.strip().splitlines()) == 1, again.stderr[-3000:]
    assert "nothing trained" in again.stderr and _files(out) == before


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_a_budget_crossed_on_the_last_step_ends_the_run_normally_and_a_rerun_is_not_refused(
    tmp_path: Path, ranks: int
) -> None:
    """$1e9/h and a $1 budget: the budget is gone within the first step. With one rank that step is the last
    (max_steps 1); with two, whose stop lands a step after rank 0 asks, the step before the last (max_steps 2).
    The run trains every step, so it finishes: exit 0, the sample printed, not interrupted; the summary still says
    what it cost. Rerunning the finished run trains nothing and is not refused over money."""
    out = tmp_path / "last"
    parallel = (
        ["--nproc-per-node", "2", "--parallel.strategy", "ddp", "--train.threads", "1"] if ranks > 1 else []
    )
    args = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--no-progress", *TINY, *parallel,
            "--train.max_steps", str(ranks), "--cost.price_usd_per_hour", "1e9", "--cost.budget_usd", "1"]  # fmt: skip
    run = subprocess.run([*args, "--sample-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "---- sample" in run.stdout and "budget reached" not in run.stderr, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == ranks and not summary["interrupted"] and summary["stop_exit_code"] is None
    assert summary["cost_usd"] > summary["cost_budget_usd"] == 1.0
    assert _stored_cost(Path(summary["checkpoint"])) == summary["cost_usd"]
    assert _cost_records(out)[0]["cost_usd"] > 1.0  # the budget was gone after the first step
    again = subprocess.run([*args, "--sample-tokens", "0"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "budget reached" not in again.stderr, again.stderr[-3000:]


def test_a_hard_kill_never_unspends_what_the_run_recorded_after_its_last_checkpoint(tmp_path: Path) -> None:
    """SIGKILL (a lost node, an OOM kill: no stop, no checkpoint) a few steps after a periodic checkpoint: its
    metrics.jsonl recorded more spend than the checkpoint holds. A resume with a budget between the two is
    refused before it trains; one without continues from the recorded figure, not the checkpoint's."""
    out = tmp_path / "killed"
    args = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--sample-tokens", "0",
            "--no-progress", *TINY, "--checkpoint.every_steps", "20", "--cost.price_usd_per_hour", "3600"]  # fmt: skip
    proc = subprocess.Popen([*args, "--train.max_steps", "100000"], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            steps = [r["step"] for r in _cost_records(out)] if (out / "metrics.jsonl").is_file() else []
            # well past a checkpoint and well before the next: a record lags its step by one, and the steps go on
            # while this loop polls (the kill must not land between the next checkpoint and its step's record)
            if (out / "checkpoints" / "latest").is_file() and steps and 4 <= steps[-1] % 20 <= 12:
                break
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    checkpoint = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    stored, recorded = _stored_cost(checkpoint), _cost_records(out)[-1]["cost_usd"]
    assert stored < recorded, (stored, recorded)

    budget = f"{(stored + recorded) / 2:.6f}"
    refused = subprocess.run([*args, "--train.max_steps", "100000", "--cost.budget_usd", budget],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert refused.returncode == 3 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-3000:]
    assert f"by checkpoint {checkpoint.name} and the steps after it" in refused.stderr
    assert "nothing trained" in refused.stderr

    step = json.loads((checkpoint / "manifest.json").read_text())["step"]
    resumed = subprocess.run([*args, "--train.max_steps", str(step + 1)], capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first = [r for r in _cost_records(out) if r["step"] == step + 1][-1]
    assert first["cost_usd"] > recorded
    assert json.loads((out / "summary.json").read_text())["cost_usd"] > recorded


def test_the_recorded_spend_refuses_a_resume_on_one_node_and_a_finished_epoch_run_is_not_refused(
    tmp_path: Path,
) -> None:
    """A run in epochs trained to its end at $1e9/h: its checkpoint holds far more than a $1 budget, and its
    metrics.jsonl then records more still (as a process killed after its checkpoint would have). Rerun with the
    budget, the finished run trains nothing and is not refused (its length resolves from the data only later: the
    check reads the steps its checkpoint's run resolved). Its recorded spend is checked on one node; across nodes
    only rank 0's node holds metrics.jsonl, so every node refuses alike on the checkpoint's figure alone."""
    from gaudi3_scale.metering.live import BudgetExhaustedError
    from gaudi3_scale.train.preflight import resume_point

    text = tmp_path / "corpus.txt"
    text.write_text("to be or not to be, that is the question\n" * 40)  # 1,640 characters: a few steps
    out = tmp_path / "epochs"
    common = ["--out_dir", str(out), *TINY, "--data.source", str(text), "--model.context_length", "32",
              "--train.global_batch_size", "8", "--train.micro_batch_size", "8", "--cost.price_usd_per_hour", "1e9"]  # fmt: skip
    config = ["--train.max_epochs", "1"]
    GaudiTrainer(build_run_config(None, parse_overrides([*common, *config])), progress=False).fit()
    budget = ["--cost.budget_usd", "1"]
    again = GaudiTrainer(build_run_config(None, parse_overrides([*common, *config, *budget])), progress=False)
    assert again.fit()["stop_exit_code"] is None  # finished: not refused over money
    # the same checkpoint as the end of a longer run: $1.50 budget, between the checkpoint's spend and a recorded one
    spent = _stored_cost(next((out / "checkpoints").glob("step-*")))
    with (out / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 99, "cost_usd": spent * 2}) + "\n")
    longer = [*common, "--train.max_steps", "1000", "--cost.budget_usd", str(spent * 1.5)]
    with pytest.raises(BudgetExhaustedError, match=r"budget reached: .* and the steps after it"):
        resume_point(build_run_config(None, parse_overrides(longer)), warn=lambda line: None)
    nodes = [
        "--parallel.nnodes",
        "2",
        "--parallel.rdzv_endpoint",
        "127.0.0.1:29400",
        "--train.micro_batch_size",
        "4",
    ]
    assert resume_point(build_run_config(None, parse_overrides([*longer, *nodes])), warn=lambda line: None)
