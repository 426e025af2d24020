"""The dashboard's progress view of a real `gaudi3 train` run (`dashboard.eta`): the forecast the run recorded
(plan.json) as a predicted line and finish, beside the measured progress its records carry (`wall_s`, `time_unix`)
and the live ETA; a run without plan.json has no predicted line, a corrupt one is one note and the page still loads.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gaudi3_scale.dashboard import create_app
from gaudi3_scale.dashboard.eta import NO_FORECAST
from gaudi3_scale.dashboard.formatting import hours
from gaudi3_scale.train.report import read_metrics

pytestmark = pytest.mark.integration

MAX_STEPS = 12
PRICE_USD_PER_HOUR = 3600.0  # a dollar a second: the accrued cost is the wall time


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A runs directory holding one finished real run, `done` (a record every 2 steps, validation and a save)."""
    runs = tmp_path_factory.mktemp("eta-runs")
    args = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(runs / "done"), "--no-progress",
            "--sample-tokens", "0", "--model.num_layers", "1", "--train.threads", "1", "--train.max_steps",
            str(MAX_STEPS), "--train.log_every_steps", "2", "--train.val_every_steps", "6",
            "--cost.price_usd_per_hour", str(PRICE_USD_PER_HOUR)]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return runs


def _copy(runs: Path, name: str) -> Path:
    target = runs / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(runs / "done", target, symlinks=True)
    return target


def _eta(runs: Path, name: str) -> dict[str, Any]:
    client = create_app(runs).test_client()
    polled = client.get(f"/api/runs/{name}/metrics?since=0")
    assert polled.status_code == 200
    detail = client.get(f"/api/runs/{name}").get_json()
    assert detail["eta"] == polled.get_json()["eta"]  # one view, served by both
    return dict(detail["eta"])


def _clock(unix_s: float) -> str:
    return time.strftime("%H:%M", time.localtime(unix_s))


def _train_records(run: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "train_loss" in r]


def test_a_finished_run_shows_its_forecast_beside_its_measured_wall_time(runs: Path) -> None:
    run = runs / "done"
    plan = json.loads((run / "plan.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    records = _train_records(run)
    # Every train record says when its window ended, on the clock of summary.json's wall_s.
    walls = [r["wall_s"] for r in records]
    assert [r["step"] for r in records] == list(range(2, MAX_STEPS + 1, 2))
    assert walls[0] > 0 and walls == sorted(walls) and walls[-1] < summary["wall_s"]
    starts = [r["time_unix"] - r["wall_s"] for r in records]
    assert max(starts) - min(starts) < 0.01  # one start: time_unix and wall_s are read at the same instant
    eta = _eta(runs, "done")
    forecast = eta["forecast"]
    wall = plan["wall"]
    assert forecast["wall_s"] == plan["predicted_wall_s"] == summary["predicted_wall_s"] > 0
    assert forecast["source"] == "catalog" and forecast["max_steps"] == MAX_STEPS
    startup, warmup, steady = (wall[k]["value"] for k in ("startup_s", "warmup_s", "steady_s"))
    warmup_steps = plan["run"]["warmup_steps"]
    assert warmup_steps == 2
    warmup_end = startup + (plan["predicted_wall_s"] - startup) * warmup / (warmup + steady)
    expected = [(0, 0), (startup, 0), (warmup_end, warmup_steps), (plan["predicted_wall_s"], MAX_STEPS)]
    assert [tuple(p) for p in forecast["points"]] == [pytest.approx(p) for p in expected]
    assert eta["note"] is None and eta["started_unix"] == pytest.approx(starts[-1])
    assert eta["predicted_finish_unix"] == pytest.approx(starts[-1] + plan["predicted_wall_s"])
    live = eta["live"]
    assert live["finished"] and live["wall_s"] == summary["wall_s"]
    assert live["difference"] == pytest.approx(summary["wall_s"] / plan["predicted_wall_s"] - 1)
    predicted = (f"predicted finish {_clock(eta['predicted_finish_unix'])} "
                 f"(forecast: {hours(plan['predicted_wall_s'] / 3600)}; source: catalog)")  # fmt: skip
    assert eta["text"] == {"predicted": predicted, "live": f"finished {_clock(live['finish_unix'])} "
                           f"({hours(summary['wall_s'] / 3600)} in all, {live['difference']:+.1%} vs the forecast)"}  # fmt: skip
    page = create_app(runs).test_client().get("/runs/done").get_data(as_text=True)
    assert predicted in page and 'id="chart-progress"' in page


def test_a_running_run_projects_its_finish_from_its_recent_pace(runs: Path) -> None:
    run = _copy(runs, "running")
    (run / "summary.json").unlink()  # still training: its records so far, written just now
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line).get("step", 0) <= 8]
    (run / "metrics.jsonl").write_text("".join(kept))
    records = _train_records(run)
    eta = _eta(runs, "running")
    live = eta["live"]
    (first, last) = records[0], records[-1]
    pace = (last["wall_s"] - first["wall_s"]) / (
        last["step"] - first["step"]
    )  # validation at step 6 included
    assert not live["finished"] and live["step"] == 8
    assert live["wall_s"] == pytest.approx(last["wall_s"] + (MAX_STEPS - 8) * pace)
    assert live["difference"] == pytest.approx(live["wall_s"] / eta["forecast"]["wall_s"] - 1)
    assert eta["text"]["live"].startswith(f"live ETA {_clock(live['finish_unix'])} (")
    # A resumed process starts its clock again: only its own records set the pace and the start.
    resumed = [{**r, "step": r["step"] + 8, "wall_s": r["wall_s"] / 2, "time_unix": r["time_unix"] + 100}
               for r in records[:2]]  # fmt: skip
    with (run / "metrics.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in resumed)
    eta = _eta(runs, "running")
    newest = resumed[-1]
    assert eta["started_unix"] == pytest.approx(newest["time_unix"] - newest["wall_s"])
    assert eta["live"]["wall_s"] == pytest.approx(newest["wall_s"])  # step 12 of 12: nothing left


def test_a_resumed_run_is_forecast_from_its_checkpoint_step(runs: Path) -> None:
    """A run resumed at step 12 and carried on to 18 forecasts that process (summary.json's wall_s is its own):
    its predicted line starts at step 12, its steady steps, validations and saves are those after step 12, and its
    cost adds the checkpoint's accrued cost to this process's."""
    run = _copy(runs, "resumed")
    spent = json.loads((run / "checkpoints" / "step-00000012" / "manifest.json").read_text())["cost_usd"]
    assert spent > 0
    args = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--config", str(run / "config.yaml"), "--out",
            str(run), "--no-progress", "--sample-tokens", "0", "--train.max_steps", "18"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads((run / "plan.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert plan["run"]["start_step"] == 12 and plan["run"]["max_steps"] == 18
    warmup_steps = plan["run"]["warmup_steps"]
    step_s, wall = plan["predicted_step_time_s"], plan["wall"]
    assert wall["steady_s"]["value"] == pytest.approx((18 - 12 - warmup_steps) * step_s)
    assert ": 1 pass(es)" in wall["validation_s"]["source"]  # at step 18 only (every 6: 12 was before)
    assert ": 1 save(s)" in wall["checkpoint_s"]["source"]
    assert plan["cost_usd"]["value"] == pytest.approx(
        spent + plan["predicted_wall_s"] * PRICE_USD_PER_HOUR / 3600
    )
    assert summary["predicted_wall_s"] == plan["predicted_wall_s"]
    assert summary["cost_usd"] > spent  # measured: accrued over both processes, as predicted
    points = _eta(runs, "resumed")["forecast"]["points"]
    assert points[0] == [0.0, 12.0] and points[-1] == [pytest.approx(plan["predicted_wall_s"]), 18.0]
    assert [p[1] for p in points] == sorted(p[1] for p in points)


def test_without_plan_json_there_is_no_predicted_line_and_it_says_so(runs: Path) -> None:
    run = _copy(runs, "no-plan")
    (run / "plan.json").unlink()
    eta = _eta(runs, "no-plan")
    assert eta["forecast"] is None and eta["note"] is None and eta["predicted_finish_unix"] is None
    assert eta["text"]["predicted"] == NO_FORECAST
    assert eta["live"]["finished"] and eta["live"]["difference"] is None
    assert "vs the forecast" not in eta["text"]["live"]


@pytest.mark.parametrize(
    ("content", "note"),
    [
        ('{"predicted_wall_s": 12.5, "run": ', "plan.json unreadable: "),
        ("[1, 2]", "plan.json unreadable: not a JSON object"),
        ('{"predicted_wall_s": "NaN"}', "plan.json has no predicted_wall_s"),
        (None, "bad-plan/plan.json links outside the runs directory; not read"),
    ],
    ids=["truncated", "not-an-object", "no-wall", "symlink-out"],
)
def test_a_bad_plan_json_is_one_note_and_the_page_still_loads(
    runs: Path, tmp_path: Path, content: str | None, note: str
) -> None:
    run = _copy(runs, "bad-plan")
    (run / "plan.json").unlink()
    if content is None:
        outside = tmp_path / "plan.json"  # a real forecast, but outside the runs directory
        shutil.copy(runs / "done" / "plan.json", outside)
        (run / "plan.json").symlink_to(outside)
    else:
        (run / "plan.json").write_text(content)
    eta = _eta(runs, "bad-plan")
    assert eta["forecast"] is None and eta["note"].startswith(note)
    assert eta["text"]["predicted"] == f"{NO_FORECAST} ({eta['note']})"
    assert eta["live"]["finished"]  # the measured side is unaffected
    page = create_app(runs).test_client().get("/runs/bad-plan")
    assert page.status_code == 200 and page.get_data(as_text=True).count(note) == 1
