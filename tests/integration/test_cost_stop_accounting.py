"""What a run says it spent agrees with what it spent, on real (tiny) CPU runs: each metrics record carries the cost
at its own step; a budget or spot stop names the step and amount its checkpoint records (also with 2 ranks, which
agree on a stop one step after rank 0 asks) and records the steps before it even with no logging window yet; the
spot policy applies without any periodic checkpoint in the run; a health rollback never lowers the accrued cost.

Prices are set so that $1 is one second of wall time (3600 USD/h on one node)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gaudi3_scale.metering.spot import SpotQuote, register_spot_provider
from gaudi3_scale.train.worker import print_outputs

pytestmark = pytest.mark.integration

CliResult = tuple[int, str, str]
TINY = ["--train.threads", "2", "--model.num_layers", "1", "--train.val_every_steps", "0",
        "--optim.warmup_steps", "2", "--sample-tokens", "0", "--no-progress"]  # fmt: skip
BUDGET_LINE = re.compile(
    r"^budget reached: \$(\d+\.\d+) accrued of the \$\d+\.\d+ budget \(cost\.budget_usd\) after step (\d+); "
    r"checkpoint committed; exit 3 — raise cost\.budget_usd to continue$"
)
SPOT = ["--cost.instance", "aws/p5.48xlarge/us-east-1", "--cost.pricing", "spot",
        "--cost.spot_provider", "test-accounting-fixed", "--cost.spot_pause_above_usd_per_hour", "40"]  # fmt: skip


class _FixedSpotPrice:
    """A price source the test controls: every node costs $50/h on the spot market."""

    name = "test-accounting-fixed"

    def __init__(self, **kwargs: Any) -> None:
        pass

    def fetch(self, instance_type: str, region: str) -> SpotQuote:
        return SpotQuote(usd_per_hour=50.0, instance_type=instance_type, region=region,
                         availability_zone=f"{region}a", provider=self.name, fetched_at_unix=time.time())  # fmt: skip


register_spot_provider("test-accounting-fixed", _FixedSpotPrice)


def _train(gaudi3_cli: Callable[..., CliResult], out: Path, *args: str) -> CliResult:
    return gaudi3_cli("train", "--out", str(out), *TINY, *args)


def _records(out: Path) -> list[dict[str, Any]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "cost_usd" in r]


def _stored_cost(checkpoint: Path) -> float:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    state = checkpoint / "state.ckpt"
    meta = torch.load(state if state.is_file() else checkpoint / "meta.pt", weights_only=True)["gaudi3_meta"]
    assert meta["cost_usd"] == manifest["cost_usd"]
    return float(manifest["cost_usd"])


def _check_stop_agrees(out: Path, stop_line: str) -> dict[str, Any]:
    """The budget line, summary.json, the checkpoint and the last metrics record name one step and one amount."""
    match = BUDGET_LINE.match(stop_line)
    assert match, stop_line
    summary = json.loads((out / "summary.json").read_text())
    steps, cost = summary["steps"], summary["cost_usd"]
    assert int(match.group(2)) == steps and match.group(1) == f"{cost:.{len(match.group(1).split('.')[1])}f}"
    assert summary["stop_reason"] == stop_line.split("; checkpoint committed")[0]
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint.name == f"step-{steps:08d}" and _stored_cost(checkpoint) == cost
    last = _records(out)[-1]
    assert (last["step"], last["cost_usd"]) == (steps, cost)
    return summary


def test_each_record_carries_the_cost_at_its_own_step(
    tmp_path: Path, gaudi3_cli: Callable[..., CliResult]
) -> None:
    """A record every step: the budget is gone only in the record of the step that spent it (the stop's), and the
    cost grows from record to record (a record written a step late would carry the next step's cost)."""
    out = tmp_path / "run"
    code, _stdout, stderr = _train(gaudi3_cli, out, "--train.max_steps", "2000", "--train.log_every_steps", "1",
                                   "--checkpoint.every_steps", "0", "--cost.price_usd_per_hour", "3600",
                                   "--cost.budget_usd", "3")  # fmt: skip
    assert code == 3, stderr
    summary = _check_stop_agrees(out, stderr.strip().splitlines()[-1])
    records = _records(out)
    assert [r["step"] for r in records] == list(range(1, summary["steps"] + 1))
    costs = [r["cost_usd"] for r in records]
    assert all(a < b for a, b in itertools.pairwise(costs)), costs
    assert all(r["cost_budget_remaining_usd"] > 0 for r in records[:-1]), records
    assert records[-1]["cost_budget_remaining_usd"] == 0.0


def test_a_budget_stop_before_the_first_logging_window_still_records_its_steps(
    tmp_path: Path, gaudi3_cli: Callable[..., CliResult]
) -> None:
    """train.log_every_steps 1000 and a budget spent in the first steps (0.5 s): the stop writes the partial
    window's record, so metrics.jsonl exists, ends at the stop with the final cost, and summary.train_loss is known."""
    out = tmp_path / "run"
    code, stdout, stderr = _train(gaudi3_cli, out, "--train.max_steps", "2000", "--train.log_every_steps", "1000",
                                  "--checkpoint.every_steps", "0", "--cost.price_usd_per_hour", "3600",
                                  "--cost.budget_usd", "0.5")  # fmt: skip
    assert code == 3, stderr
    summary = _check_stop_agrees(out, stderr.strip().splitlines()[-1])
    assert summary["steps"] < 1000 and summary["train_loss"] is not None
    (record,) = _records(out)
    assert record["window_steps"] == summary["steps"] and record["train_loss"] == summary["train_loss"]
    assert f"outputs: {out}/ (config.yaml, metrics.jsonl, summary.json, loss.png, checkpoints/)" in stdout


def test_the_outputs_line_lists_only_files_that_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.yaml").write_text("{}\n")
    (tmp_path / "summary.json").write_text("{}\n")
    run = SimpleNamespace(trainer=SimpleNamespace(out_dir=tmp_path), summary={"checkpoint": None})
    print_outputs(run)  # type: ignore[arg-type]
    assert capsys.readouterr().out == f"outputs: {tmp_path}/ (config.yaml, summary.json)\n"


def test_the_spot_policy_pauses_without_a_checkpoint_boundary_in_the_run(
    tmp_path: Path, gaudi3_cli: Callable[..., CliResult]
) -> None:
    """checkpoint.every_steps at its default (500) and 30 steps: the quote ($50/h, above the $40/h threshold)
    still pauses the run at the first step boundary after it arrives: a checkpoint of that step, exit 4; every
    record before the pause continued on the catalog's high end, the pause's record carries the quote's rate."""
    out = tmp_path / "run"
    code, _stdout, stderr = _train(
        gaudi3_cli, out, "--train.max_steps", "30", "--train.log_every_steps", "1", *SPOT
    )
    assert code == 4, stderr
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["stop_exit_code"] == 4 and 0 < steps < 30
    reason = "spot pause: spot price $50.00/h (p5.48xlarge, us-east-1) is above the pause threshold $40.00/h"
    assert summary["stop_reason"] == f"{reason} (cost.spot_pause_above_usd_per_hour) after step {steps}"
    assert (
        stderr.strip().splitlines()[-1].startswith(f"{summary['stop_reason']}; checkpoint committed; exit 4")
    )
    assert Path(summary["checkpoint"]).name == f"step-{steps:08d}"
    assert _stored_cost(Path(summary["checkpoint"])) == summary["cost_usd"]
    records = _records(out)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["spot_decision"] == 0.0 and r["cost_usd_per_hour"] == 55.04 for r in records[:-1]), records
    assert (records[-1]["spot_decision"], records[-1]["cost_usd_per_hour"]) == (1.0, 50.0)


def test_a_health_rollback_never_lowers_the_accrued_cost(tmp_path: Path) -> None:
    """A spike at step 5 rolls back to the checkpoint of step 4: the time spent since that checkpoint, and on the
    rollback itself, is still billed; the cost record of the re-trained step is the one before the rollback plus
    the wall time in between."""
    out = tmp_path / "run"
    env = {**os.environ, "GAUDI3_INJECT_FAULTS": "spike:step=5:scale=20"}
    args = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), *TINY, "--train.max_steps", "6",
            "--train.log_every_steps", "1", "--checkpoint.every_steps", "2", "--health.spike_window_steps", "3",
            "--health.spike_warmup_steps", "3", "--health.spike_policy", "rollback",
            "--health.rollback_skip_batches", "2", "--cost.price_usd_per_hour", "3600"]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (at,) = [i for i, r in enumerate(lines) if r.get("health_event") == "rollback"]
    assert lines[at]["to_step"] == 4
    before = [r for r in lines[:at] if "cost_usd" in r]
    after = [r for r in lines[at:] if "cost_usd" in r]
    costs = [r["cost_usd"] for r in before + after]
    assert costs == sorted(costs), costs
    last, first = before[-1], after[0]
    assert first["cost_usd"] - last["cost_usd"] >= 0.8 * (first["wall_s"] - last["wall_s"]) > 0, (last, first)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cost_usd"] >= costs[-1]
    assert _stored_cost(Path(summary["checkpoint"])) == summary["cost_usd"]


@pytest.mark.distributed
def test_two_ranks_stop_line_names_the_step_and_cost_they_stopped_at(tmp_path: Path) -> None:
    """Rank 0 asks for the budget stop; the ranks agree one step later and checkpoint that step. The line, the
    summary and the checkpoint name that step and the cost accrued by then, and the steps since the last record
    (train.log_every_steps 1000: all of them) are recorded on the way out."""
    out = tmp_path / "ddp"
    args = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), *TINY, "--nproc-per-node", "2",
            "--parallel.strategy", "ddp", "--train.threads", "1", "--train.max_steps", "2000",
            "--train.log_every_steps", "1000", "--checkpoint.every_steps", "0", "--cost.price_usd_per_hour", "3600",
            "--cost.budget_usd", "1"]  # fmt: skip
    run = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert run.returncode == 3, run.stderr[-3000:]
    asked = [line for line in run.stderr.splitlines() if line.endswith("saving a checkpoint after this step")]
    stops = [line for line in run.stderr.splitlines() if "exit 3 — raise cost.budget_usd to continue" in line]
    assert len(asked) == 1 and len(stops) == 1, run.stderr[-3000:]
    summary = _check_stop_agrees(out, stops[0])
    asked_step = int(re.search(r"after step (\d+)", asked[0]).group(1))  # type: ignore[union-attr]
    assert summary["steps"] >= asked_step and summary["cost_usd"] >= 1.0
    assert (
        len(_records(out)) == 1
    )  # the partial window, written by both ranks' flush (its collectives) on rank 0


def test_a_budget_stop_without_checkpoints_says_so_from_its_first_line(tmp_path: Path) -> None:
    """checkpoint.enabled false: the line printed when the budget is reached says the run stops, not that it saves
    a checkpoint, and the last line says a rerun starts from step 0 (raising the budget resumes nothing)."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), *TINY, "--train.max_steps", "1000",
            "--checkpoint.enabled", "false", "--cost.price_usd_per_hour", "100000", "--cost.budget_usd", "1"]  # fmt: skip
    run = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert run.returncode == 3, run.stderr[-3000:]
    assert "saving a checkpoint" not in run.stderr and "raise cost.budget_usd" not in run.stderr, run.stderr
    (asked,) = [
        line for line in run.stderr.splitlines() if line.startswith("budget reached") and "; " not in line
    ]
    assert re.fullmatch(
        # the budget in as many decimals as tell it from what accrued ($1.001 of $1.000 on a fast machine)
        r"budget reached: \$\S+ accrued of the \$1\.00+ budget \(cost\.budget_usd\) after step \d+: stopping after "
        r"this step \(checkpoint\.enabled is false: nothing is saved\)",
        asked,
    ), asked
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "; no checkpoint saved (checkpoint.enabled is false); exit 3 — nothing to resume: a rerun starts again "
            "from step 0"
        )
    )
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())
