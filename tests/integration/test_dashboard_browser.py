"""The dashboard in headless Chromium (Selenium, Debian's chromium + chromedriver) against a real `gaudi3 train`:
the run list, a chart that gains points while the run writes metrics, the cost view's numbers, and the health
events of real runs with injected faults marked on the loss curve.

Screenshots go to test-artifacts/dashboard/ at the repository root. Without chromium or chromedriver these tests
skip, unless GAUDI3_REQUIRE_SYSTEM_TOOLS=1 (CI), where they fail saying what is missing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import missing_system_tool
from gaudi3_scale.config.core import from_dict, to_dict
from gaudi3_scale.cost.estimate import compare_training_cost
from gaudi3_scale.cost.report import usd
from gaudi3_scale.dashboard import build_server
from gaudi3_scale.dashboard.costs import ASSUMED_MFU, PLATFORMS
from gaudi3_scale.health.marks import MARKS, event_mark
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.registry import get_model_config
from gaudi3_scale.train.report import read_metrics

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"


def _missing_tools() -> str | None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.is_file()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if not missing:
        return None
    return f"browser tests need {', '.join(missing)} (apt-get install chromium chromium-driver)"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    reason = _missing_tools()
    if reason is not None:
        missing_system_tool(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1000"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dashboard-runs")


@pytest.fixture(scope="module")
def dashboard(runs_dir: Path) -> Iterator[str]:
    server = build_server(runs_dir, "127.0.0.1", 0, None)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.port}"
    server.shutdown()
    thread.join(timeout=10)


def _wait_for(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _screenshot(driver: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def _points(driver: Any, chart_id: str) -> int:
    return int(driver.find_element("id", chart_id).get_attribute("data-points"))


def _metric_lines(path: Path) -> int:
    return path.read_text().count("\n") if path.is_file() else 0


@pytest.fixture
def live_run(
    runs_dir: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A real `gaudi3 train` logging every step, long enough to be watched (stopped once the test has seen it), in a
    run directory of its own: "live", or the name a test gives with `@pytest.mark.parametrize("live_run", [NAME],
    indirect=True)`."""
    name = getattr(request, "param", "live")
    out = runs_dir / name
    args = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--model.num_layers", "1",
            "--train.threads", "1", "--train.log_every_steps", "1", "--train.max_steps", "400",
            "--train.val_every_steps", "100", "--sample-tokens", "0", "--no-progress"]  # fmt: skip
    log = (runs_dir / f"{name}.log").open("wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    yield proc, out
    if proc.poll() is None:
        proc.terminate()  # SIGTERM: the trainer saves and exits (preemption handling)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()


def test_live_run_curves_grow_while_it_trains(
    browser: Any, dashboard: str, live_run: tuple[subprocess.Popen[bytes], Path], runs_dir: Path
) -> None:
    proc, out = live_run
    metrics = out / "metrics.jsonl"
    _wait_for(lambda: _metric_lines(metrics) >= 2 or proc.poll() is not None, 120, "the run's first metrics")
    assert proc.poll() is None, (runs_dir / "live.log").read_text()[-2000:]

    browser.get(f"{dashboard}/")
    link = browser.find_element("css selector", 'tr[data-run="live"] a')
    assert link.text == "live"
    _screenshot(browser, "run-list")

    link.click()
    _wait_for(lambda: browser.current_url.endswith("/runs/live"), 30, "the run page")
    first = _wait_for(lambda: _points(browser, "chart-loss"), 30, "the loss chart's first points")
    lines_then = _metric_lines(metrics)
    later = _wait_for(lambda: (n := _points(browser, "chart-loss")) > first and n, 60, "more loss points")
    assert proc.poll() is None, "the run ended before the chart was seen to grow"
    assert _metric_lines(metrics) > lines_then  # the points came from lines written meanwhile
    for chart in ("chart-throughput", "chart-mfu"):
        assert _points(browser, chart) > 0, chart
    polylines = browser.find_elements("css selector", "#chart-loss svg polyline")
    assert polylines and len(polylines[0].get_attribute("points").split()) > 1
    assert browser.find_element("css selector", '#stats [data-field="step"]').text.endswith("/ 400")
    assert browser.find_element("css selector", '[data-field="status"]').text == "running"
    assert later > first
    _screenshot(browser, "live-run")

    browser.get(f"{dashboard}/system")
    _wait_for(lambda: _points(browser, "chart-cpu") >= 2, 30, "two CPU samples")
    row = browser.find_element("css selector", '#run-resources tr[data-run="live"]')
    # One rank: its compute is measured, and nobody is slower than the median.
    assert row.find_element("css selector", '[data-field="stragglers"]').text == "none"
    _screenshot(browser, "resources")


def _api(dashboard: str, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{dashboard}{path}", timeout=30) as response:
        return dict(json.loads(response.read()))


@pytest.mark.parametrize("live_run", ["eta"], indirect=True)  # a run of its own: no earlier run's files
def test_the_progress_chart_draws_the_forecast_beside_the_live_run(
    browser: Any, dashboard: str, live_run: tuple[subprocess.Popen[bytes], Path], runs_dir: Path
) -> None:
    proc, out = live_run
    _wait_for(
        lambda: _metric_lines(out / "metrics.jsonl") >= 3 or proc.poll() is not None, 120, "three records"
    )
    assert proc.poll() is None, (runs_dir / "eta.log").read_text()[-2000:]
    assert (out / "plan.json").is_file()  # recorded at the run's start, not at its end
    browser.get(f"{dashboard}/runs/eta")
    predicted_css = "#chart-progress svg polyline.line.s1.dashed"
    _wait_for(lambda: browser.find_elements("css selector", predicted_css), 30, "the predicted line")
    measured = _wait_for(
        lambda: [line for line in browser.find_elements("css selector", "#chart-progress svg polyline.line.s0")
                 if len(_polyline(line)) >= 2], 30, "two measured points")  # fmt: skip
    eta = _api(dashboard, "/api/runs/eta")["eta"]
    forecast = eta["forecast"]
    (predicted,) = browser.find_elements("css selector", predicted_css)
    drawn = _polyline(predicted)
    # The forecast's own points, (0, 0) … (predicted_wall_s, 400): left to right, and up to the top step.
    assert len(drawn) == len(forecast["points"]) >= 3 and forecast["points"][-1][1] == 400
    assert [x for x, _ in drawn] == sorted(x for x, _ in drawn)
    assert drawn[-1][1] == min(y for _, y in drawn) < drawn[0][1]  # SVG y grows downwards
    assert _polyline(measured[0])[0][0] > drawn[0][0]  # measured steps start after the run's start
    legend = browser.find_element("css selector", "#chart-progress figcaption .legend").text
    assert "measured" in legend and "predicted" in legend
    shown = browser.find_element("css selector", '#eta [data-eta="predicted"]')
    assert shown.is_displayed() and shown.text == eta["text"]["predicted"]
    assert re.fullmatch(r"predicted finish \d\d:\d\d \(forecast: .+; source: catalog\)", shown.text)
    live = _wait_for(
        lambda: browser.find_element("css selector", '#eta [data-eta="live"]').text, 30, "the live ETA"
    )
    assert re.fullmatch(r"live ETA \d\d:\d\d \(.+ in all, [+-]\d+\.\d% vs the forecast\)", live)
    assert proc.poll() is None  # all of it while the run trains
    _screenshot(browser, "progress-eta")


def _forecastless_runs(runs_dir: Path) -> None:
    """Two runs of a few records: one without plan.json (a run from before forecasts), one whose plan.json is
    cut short."""
    for name in ("no-forecast", "corrupt-forecast"):
        run = runs_dir / name
        run.mkdir()
        (run / "config.yaml").write_text(yaml.safe_dump({"name": name, "train": {"max_steps": 6}}))
        records = [{"step": s, "train_loss": 4.0 - s / 10, "wall_s": 1.0 + s, "time_unix": 1.7e9 + s,
                    "step_time_s": 1.0} for s in (2, 4)]  # fmt: skip
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (runs_dir / "corrupt-forecast" / "plan.json").write_text('{"predicted_wall_s": 12.5, "run": {')


@pytest.mark.parametrize("name", ["no-forecast", "corrupt-forecast"])
def test_a_run_without_a_readable_forecast_says_so_and_draws_its_progress(
    browser: Any, dashboard: str, runs_dir: Path, name: str
) -> None:
    if not (runs_dir / name).is_dir():
        _forecastless_runs(runs_dir)
    browser.get(f"{dashboard}/runs/{name}")
    _wait_for(lambda: _points(browser, "chart-progress") == 2, 30, "the two measured points")
    assert _points(browser, "chart-loss") == 2  # the rest of the page works
    assert not browser.find_elements("css selector", "#chart-progress svg polyline.s1")
    text = browser.find_element("css selector", '#eta [data-eta="predicted"]').text
    if name == "no-forecast":
        assert text == "no forecast for this run"
    else:
        assert text.startswith("no forecast for this run (plan.json unreadable: ")
    live = browser.find_element("css selector", '#eta [data-eta="live"]').text
    assert (
        live.startswith("live ETA ") and "forecast" not in live
    )  # measured progress: nothing to compare with
    _screenshot(browser, name)


def _priced_run(runs_dir: Path) -> tuple[str, dict[str, Any]]:
    """A run of GPT-2 124M on 105B planned tokens with live cost records: real dollars on every priced platform."""
    model = to_dict(get_model_config("gpt2-124m"))
    config = {"name": "priced", "model": model, "train": {"max_steps": 200_000, "global_batch_size": 512}}
    run = runs_dir / "priced"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    record = {"step": 10, "train_loss": 6.1, "tokens_per_s": 5e5, "mfu": 0.38, "peak_memory_bytes": 30 * 2**30,
              "cost_usd": 321.09, "cost_usd_per_hour": 98.32, "cost_projected_usd": 40123.5,
              "cost_budget_usd": 50000.0, "cost_budget_remaining_usd": 49678.91, "projected_finish_unix": 2e9}  # fmt: skip
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    return "priced", config


def test_cost_view_shows_the_cost_modules_numbers(browser: Any, dashboard: str, runs_dir: Path) -> None:
    name, config = _priced_run(runs_dir)
    tokens = 200_000 * 512 * config["model"]["context_length"]
    expected = compare_training_cost(
        from_dict(ModelConfig, config["model"]), tokens, list(PLATFORMS), mfu=ASSUMED_MFU
    )
    browser.get(f"{dashboard}/runs/{name}/cost")

    def cell(platform: str, field: str) -> str:
        selector = f'#tco tr[data-platform="{platform}"] td[data-field="{field}"]'
        return browser.find_element("css selector", selector).text

    for row in expected.rows:
        assert cell(row.platform, "on_demand") == usd(row.on_demand_usd), row.platform
        per_million = "unknown" if row.usd_per_million_tokens is None else f"{row.usd_per_million_tokens:,.4f}"  # fmt: skip
        assert cell(row.platform, "per_million_tokens") == per_million, row.platform
    shown = [cell(row.platform, "on_demand") for row in expected.rows]
    assert "unknown" in shown and any(s.startswith("$") and s != "$0.00" for s in shown)
    live = {key: browser.find_element("css selector", f'[data-live="{key}"]').text
            for key in ("accrued", "projected", "budget")}  # fmt: skip
    assert live == {"accrued": usd(321.09), "projected": usd(40123.5), "budget": usd(50000.0)}
    _screenshot(browser, "cost")


def _diverged_run(runs_dir: Path) -> str:
    """A run whose loss went NaN at step 3 and recovered (e.g. a skipped bad batch), written as runs before the strict
    encoder wrote it: a bare NaN in metrics.jsonl, which JSON.parse refuses."""
    run = runs_dir / "diverged"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"name": "diverged", "train": {"max_steps": 6}}))
    losses = {1: 4.0, 2: 3.8, 3: float("nan"), 4: 3.5, 5: 3.4, 6: 3.3}
    records = [
        {"step": s, "train_loss": loss, "tokens_per_s": 1000.0 + s, "mfu": 0.3} for s, loss in losses.items()
    ]
    records += [{"step": 2, "val_loss": 3.9}, {"step": 6, "val_loss": 3.4}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return "diverged"


def test_a_nan_in_the_middle_of_a_run_is_a_gap_with_a_marker(
    browser: Any, dashboard: str, runs_dir: Path
) -> None:
    name = _diverged_run(runs_dir)
    browser.get(f"{dashboard}/runs/{name}")
    _wait_for(
        lambda: _points(browser, "chart-loss") == 7, 30, "the loss chart's 5 train and 2 validation points"
    )
    assert browser.find_element("id", "connection").text == "· live"  # the metrics parsed
    chart = browser.find_element("id", "chart-loss")
    assert chart.get_attribute("data-gaps") == "1"
    segments = [[tuple(map(float, p.split(","))) for p in line.get_attribute("points").split()]
                for line in chart.find_elements("css selector", "svg polyline.line.s0")]  # fmt: skip
    assert [len(points) for points in segments] == [2, 3]  # steps 1-2, then 4-6: no line through step 3
    marker = chart.find_element("css selector", "svg .gap.s0")
    assert marker.get_attribute("data-step") == "3" and marker.get_attribute("data-value") == "NaN"
    assert marker.is_displayed() and marker.text == "NaN"
    x = float(marker.get_attribute("data-x"))
    assert segments[0][-1][0] < x < segments[1][0][0]  # the gap is where step 3 is, with points after it
    _screenshot(browser, "diverged")


# Real runs with faults injected (GAUDI3_INJECT_FAULTS, keyed by data step): spikes looked for after 4 steps, a
# checkpoint every 2 steps. name: (health.spike_policy, faults, the marks expected as (mark, event, step)).
#   rollback: the NaN of data step 3 drops the update of step 3, so data step 10 is step 9; its spike rolls back
#             to the checkpoint of step 8 and the run trains steps 9-12 again on later batches;
#   warn / skip: the spike of data step 8 (step 8) is warned of (update applied) / dropped.
HEALTH_STEPS = 12
HEALTH_RUNS = {
    "health-rollback": ("rollback", "nan:step=3,spike:step=10:scale=20",
                        [("dropped", "nonfinite", 3), ("rollback", "rollback", 9)]),
    "health-warn": ("warn", "spike:step=8:scale=20", [("spike", "loss_spike", 8)]),
    "health-skip": ("skip", "spike:step=8:scale=20", [("dropped", "loss_spike", 8)]),
}  # fmt: skip


@pytest.fixture(scope="module")
def health_runs(runs_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """The three runs of HEALTH_RUNS, side by side (a few seconds each): name → the health events they wrote."""
    procs = {}
    for name, (policy, faults, _) in HEALTH_RUNS.items():
        args = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(runs_dir / name), "--name", name,
                "--no-progress", "--sample-tokens", "0", "--model.num_layers", "1", "--train.threads", "1",
                "--train.max_steps", str(HEALTH_STEPS), "--train.log_every_steps", "1", "--train.val_every_steps", "0",
                "--checkpoint.every_steps", "2", "--checkpoint.keep_last", "10", "--health.spike_window_steps", "5",
                "--health.spike_warmup_steps", "4", "--health.spike_policy", policy,
                "--health.rollback_skip_batches", "3"]  # fmt: skip
        env = {**os.environ, "GAUDI3_INJECT_FAULTS": faults}
        procs[name] = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env=env)  # fmt: skip
    events = {}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output[-3000:]
        records = read_metrics(runs_dir / name / "metrics.jsonl")
        events[name] = [r for r in records if "health_event" in r]
    return events


def _polyline(element: Any) -> list[tuple[float, float]]:
    pairs = (point.split(",") for point in element.get_attribute("points").split())
    return [(float(x), float(y)) for x, y in pairs]


@pytest.mark.parametrize("name", list(HEALTH_RUNS))
def test_health_events_of_a_real_run_are_marked_on_the_loss_curve(
    browser: Any, dashboard: str, health_runs: dict[str, list[dict[str, Any]]], name: str
) -> None:
    expected = HEALTH_RUNS[name][2]
    events = health_runs[name]
    # The run saw the faults where they were injected (a spike that rolled back is marked by its rollback).
    assert [(event_mark(e), e["health_event"], e["step"]) for e in events if event_mark(e)] == expected
    browser.get(f"{dashboard}/runs/{name}")
    # The train curve and the final validation point; every step once: after the rollback the run's newer records
    # of step 9 on replace the older ones.
    _wait_for(lambda: _points(browser, "chart-loss") == HEALTH_STEPS + 1, 30, "the loss curve and val loss")
    chart = browser.find_element("id", "chart-loss")
    assert chart.get_attribute("data-marks") == str(len(expected))
    (line,) = chart.find_elements("css selector", "svg polyline.line.s0")
    x_of_step = dict(zip(range(1, HEALTH_STEPS + 1), (x for x, _ in _polyline(line)), strict=True))
    assert list(x_of_step.values()) == sorted(x_of_step.values())
    marks = chart.find_elements("css selector", "svg g.health-mark")
    shown = [(m.get_attribute("data-mark"), m.get_attribute("data-event"), int(m.get_attribute("data-step")))
             for m in marks]  # fmt: skip
    assert shown == expected
    for mark, (kind, _, step) in zip(marks, expected, strict=True):
        assert mark.is_displayed() and "health-mark " + kind == mark.get_attribute("class")
        # where it happened: a warned spike on the point of its loss (the train record of the update it made, one
        # step on), a dropped update halfway to the next update's point, a rollback at the step it went back from
        at = {"spike": step + 1.0, "dropped": step + 0.5, "rollback": float(step)}[kind]
        whole = int(at)
        x = x_of_step[whole] + (at - whole) * (x_of_step[whole + 1] - x_of_step[whole] if at > whole else 0.0)
        assert float(mark.get_attribute("data-x")) == pytest.approx(x, abs=0.06)
        title = mark.find_element("css selector", "title").get_attribute("textContent")
        (event,) = [e for e in events if e["step"] == step and event_mark(e) == kind]
        assert title == f"{MARKS[kind][0]} at step {step}: {event['detail']} ({MARKS[kind][1]})"
        if kind == "rollback":
            assert (mark.get_attribute("data-from-step"), mark.get_attribute("data-to-step")) == ("9", "8")
            band = mark.find_element("css selector", "rect.span")
            left, width = float(band.get_attribute("x")), float(band.get_attribute("width"))
            assert (left, left + width) == pytest.approx((x_of_step[8], x_of_step[9]), abs=0.06)
            assert "rolled back from step 9 to checkpoint step 8; data batches 9–11 skipped" in title
    legend = chart.find_elements("css selector", "figcaption .mark-entry")
    kinds = [k for k in MARKS if k in {kind for kind, _, _ in expected}]
    assert [(e.text, e.get_attribute("title")) for e in legend] == [MARKS[k] for k in kinds]
    _screenshot(browser, name)


def _quiet_run(runs_dir: Path, name: str, records: list[dict[str, Any]]) -> None:
    """A run that stopped a while ago (no summary.json, nothing written for minutes): polled every second."""
    run = runs_dir / name
    run.mkdir()
    (run / "config.yaml").write_text(
        yaml.safe_dump({"model": {"name": "tiny"}, "train": {"max_steps": 1000}})
    )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    old = time.time() - 600
    for path in (run / "config.yaml", run / "metrics.jsonl"):
        os.utime(path, (old, old))


def test_a_name_with_a_carriage_return_is_polled_as_itself(
    browser: Any, dashboard: str, runs_dir: Path
) -> None:
    """An HTML attribute would turn the "\\r" into "\\n": the run list would reload at every poll, and the run page
    would poll a run that does not exist. The pages carry names as JSON."""
    _quiet_run(runs_dir, "cr\rname", [{"step": s, "train_loss": 3.0 - s / 10} for s in (1, 2, 3)])
    browser.get(f"{dashboard}/runs/cr%0Dname")
    _wait_for(lambda: _points(browser, "chart-loss") == 3, 30, "the run's three loss points")
    assert browser.find_element("id", "connection").text == "· live"
    browser.get(f"{dashboard}/")
    browser.execute_script("window.notReloaded = true;")
    time.sleep(6)  # the run list polls every 5 s
    assert browser.execute_script("return window.notReloaded === true;")


def test_an_unchanged_run_is_not_redrawn_and_many_marks_are_thinned(
    browser: Any, dashboard: str, runs_dir: Path
) -> None:
    """A poll that brings nothing new draws nothing (the chart's elements stay the same ones), and a run that warned
    of a spike at each of 1,000 steps is drawn with a few hundred marks, not 1,000 lines."""
    records: list[dict[str, Any]] = []
    for step in range(1, 1001):
        records.append({"step": step, "train_loss": 3.0})
        records.append(
            {"step": step, "health_event": "loss_spike", "health_action": "warn", "detail": "spike"}
        )
    _quiet_run(runs_dir, "many-marks", records)
    browser.get(f"{dashboard}/runs/many-marks")
    _wait_for(lambda: _points(browser, "chart-loss") == 1000, 30, "the run's loss points")
    chart = browser.find_element("id", "chart-loss")
    assert chart.get_attribute("data-marks") == "1000"
    drawn = len(chart.find_elements("css selector", "svg g.health-mark"))
    assert drawn == int(chart.get_attribute("data-marks-drawn")) and drawn <= 201
    browser.execute_script("window.axis = document.querySelector('#chart-loss svg line.axis');")
    time.sleep(2.5)  # two polls of a stopped run, with no new lines
    assert browser.execute_script("return window.axis.isConnected;")
