"""The dashboard's JSON API and pages through Flask's test client: listing, incremental metrics, corrupt lines,
checkpoint verification, cost numbers equal to the cost module's, auth off loopback, path traversal, read-only."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import strict_json_loads
from gaudi3_scale.cli import dashboard_cmd
from gaudi3_scale.config import strict_json
from gaudi3_scale.config.core import from_dict
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.cost import report as cost_report
from gaudi3_scale.cost.estimate import compare_training_cost
from gaudi3_scale.cost.report import usd
from gaudi3_scale.dashboard import build_server, create_app
from gaudi3_scale.dashboard.checkpoints import CheckpointVerifier
from gaudi3_scale.dashboard.costs import ASSUMED_MFU, PLATFORMS
from gaudi3_scale.dashboard.formatting import hours
from gaudi3_scale.dashboard.security import COOKIE_NAME, TOKEN_ENV
from gaudi3_scale.dashboard.server import resolve_token
from gaudi3_scale.health.marks import MARKS
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.registry import get_model_config

CliResult = tuple[int, str, str]


def _train_record(step: int, **extra: Any) -> dict[str, Any]:
    return {"step": step, "train_loss": 4.0 - step / 100, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0 + step,
            "step_time_s": 0.5, "mfu": 0.3, "peak_memory_bytes": 2**30 + step, **extra}  # fmt: skip


def _config(model: str = "shakespeare-char", max_steps: int = 100, batch: int = 12) -> dict[str, Any]:
    """A resolved config.yaml as `gaudi3 train` writes it (the model section is the preset's full shape)."""
    from gaudi3_scale.config.core import to_dict

    shape = to_dict(get_model_config(model))
    shape["vocab_size"] = shape["vocab_size"] or 65
    return {"name": "r", "model": shape, "train": {"max_steps": max_steps, "global_batch_size": batch}}


def _make_run(runs: Path, name: str, records: list[dict[str, Any]], config: dict[str, Any] | None = None) -> Path:  # fmt: skip
    run = runs / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config or _config()))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    directory = tmp_path / "runs"
    _make_run(directory, "alpha", [_train_record(s) for s in (1, 2, 3)])
    return directory


@pytest.fixture
def client(runs: Path) -> Any:
    return create_app(runs).test_client()


def test_run_list_names_runs_and_benchmarks_only(runs: Path, client: Any) -> None:
    _make_run(runs, "beta", [_train_record(10), {"step": 10, "val_loss": 3.5}])
    bench = runs / "bench-cpu"
    (bench / "cells").mkdir(parents=True)
    (bench / "matrix.yaml").write_text("name: cpu\n")
    (bench / "report").mkdir()
    (bench / "report" / "report.html").write_text("<html><body><h1>bench report</h1></body></html>")
    (runs / "empty").mkdir()
    (runs / "notes.txt").write_text("not a run")

    data = client.get("/api/runs").get_json()
    assert [r["name"] for r in data["runs"]] == ["alpha", "beta"]
    beta = data["runs"][1]
    assert beta["step"] == 10 and beta["val_loss"] == 3.5 and beta["text"]["val_loss"] == "3.5000"
    assert beta["text"]["step"] == "10 / 100" and beta["peak_memory_bytes"] == 2**30 + 10
    assert data["benchmarks"] == [{"name": "bench-cpu", "report": True}]
    page = client.get("/").get_data(as_text=True)
    assert 'href="/runs/alpha"' in page and 'href="/bench/bench-cpu"' in page and "empty" not in page
    bench_page = client.get("/bench/bench-cpu").get_data(as_text=True)
    assert 'src="/bench/bench-cpu/report.html"' in bench_page and "no benchmark results found" in bench_page
    report = client.get("/bench/bench-cpu/report.html")
    assert report.status_code == 200 and b"bench report" in report.data
    assert "sandbox" in report.headers["Content-Security-Policy"]
    assert client.get("/runs/bench-cpu").status_code == 404  # a benchmark is not a run


def _bench_result(strategy: str, status: str, reason: str = "") -> dict[str, Any]:
    """A valid benchmark result (bench.schema version 1) of a 1-rank CPU cell."""
    from gaudi3_scale.bench.result import cell_section
    from gaudi3_scale.bench.schema import validate_result
    from gaudi3_scale.distributed.plan import BatchPlan

    cell = cell_section(cell_id=f"tiny.{strategy}.w1", matrix="t", model="tiny", strategy=strategy, world_size=1,
                        nnodes=1, batch=BatchPlan.from_micro_batch(4, context_length=64), precision="32-true",
                        data="synthetic")  # fmt: skip
    metrics = None
    if status == "ok":
        metrics = {"tokens_per_s": 12345.6, "samples_per_s": 192.9, "peak_memory_bytes": 3 * 2**30,
                   "step_time_s": {"mean": 0.02, "p50": 0.02, "p95": 0.03, "n": 8}, "h2d_gbps": None,
                   "peak_memory_bytes_per_rank": [3 * 2**30], "mean_loss": 4.2, "mfu": 0.0123,
                   "scaling_efficiency": 1.0}  # fmt: skip
    result = {"schema": "gaudi3-scale/benchmark-result", "schema_version": 1, "cell": cell, "status": status,
              "reason": reason, "metrics": metrics, "steps": {"warmup": 2, "measured": 8},
              "environment": {"cpu": "test", "cuda": None}, "created": "2026-01-02T03:04:05+00:00"}  # fmt: skip
    return validate_result(result, "test")


def test_benchmark_cells_and_names_are_shown_escaped(runs: Path, client: Any) -> None:
    bench = runs / "bench"
    (bench / "cells").mkdir(parents=True)
    (bench / "matrix.yaml").write_text("name: t\n")
    for result in (_bench_result("ddp", "ok"), _bench_result("fsdp", "oom", "<script>alert(1)</script>")):
        (bench / "cells" / result["cell"]["id"]).mkdir()
        (bench / "cells" / result["cell"]["id"] / "result.json").write_text(json.dumps(result))
    data = client.get("/api/benchmarks/bench").get_json()
    assert data["report"] is None and data["problem"] is None
    assert [(c["strategy"], c["status"], c["tokens_per_s"], c["mfu"]) for c in data["cells"]] == [
        ("ddp", "ok", "12,346", "1.23%"), ("fsdp", "oom", "—", "—")]  # fmt: skip
    page = client.get("/bench/bench").text
    assert "12,346" in page and "<script>alert" not in page and "&lt;script&gt;alert(1)" in page
    _make_run(runs, "<img src=x onerror=alert(1)>", [_train_record(1)])
    index = client.get("/").text
    assert "<img src=x" not in index and "&lt;img src=x onerror=alert(1)&gt;" in index
    detail = client.get("/api/runs/%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E").get_json()
    assert detail["name"] == "<img src=x onerror=alert(1)>"


def test_a_damaged_benchmark_result_is_shown_as_damaged_beside_the_others(runs: Path, client: Any) -> None:
    """A result.json cut short before its schema string (the runner sorts keys: "schema" is near the end) is a row
    of its own, not dropped (the report refuses the set)."""
    bench = runs / "bench-cut"
    bench.mkdir()
    (bench / "matrix.yaml").write_text("name: t\n")
    for result in (_bench_result("ddp", "ok"), _bench_result("fsdp", "ok")):
        path = bench / "cells" / result["cell"]["id"] / "result.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(result, sort_keys=True, indent=2))
    cut = bench / "cells" / "tiny.fsdp.w1" / "result.json"
    cut.write_text(cut.read_text()[:200])
    data = client.get("/api/benchmarks/bench-cut").get_json()
    assert data["problem"] is None
    assert [(c["id"], c["status"]) for c in data["cells"]] == [
        ("tiny.ddp.w1", "ok"), ("cells/tiny.fsdp.w1/result.json", "damaged")]  # fmt: skip
    damaged = data["cells"][1]
    assert (
        damaged["reason"].startswith(f"{cut}: not valid JSON") and "run its cell again" in damaged["reason"]
    )
    assert damaged["tokens_per_s"] == "—"
    page = client.get("/bench/bench-cut").text
    assert "cells/tiny.fsdp.w1/result.json" in page and "damaged" in page


def test_metrics_are_polled_incrementally_by_line_offset(runs: Path, client: Any) -> None:
    first = client.get("/api/runs/alpha/metrics?since=0").get_json()
    assert [r["step"] for r in first["records"]] == [1, 2, 3] and first["next"] == 3 and not first["reset"]
    path = runs / "alpha" / "metrics.jsonl"
    with path.open("a") as f:
        f.write(json.dumps(_train_record(4)) + "\n" + json.dumps({"step": 4, "val_loss": 3.9}) + "\n")
        f.write('{"step": 5, "train_lo')  # the trainer is in the middle of this line
    second = client.get("/api/runs/alpha/metrics?since=3").get_json()
    assert second["records"] == [_train_record(4), {"step": 4, "val_loss": 3.9}] and second["next"] == 5
    assert second["run"]["unreadable_lines"] == 0  # a line being written is not a damaged one
    with path.open("a") as f:
        f.write('ss": 3.0}\n')
    third = client.get("/api/runs/alpha/metrics?since=5").get_json()
    assert third["records"] == [{"step": 5, "train_loss": 3.0}] and third["next"] == 6
    assert client.get("/api/runs/alpha/metrics?since=6").get_json()["records"] == []
    replaced = client.get("/api/runs/alpha/metrics?since=99").get_json()  # the file is shorter: start over
    assert replaced["reset"] and len(replaced["records"]) == 6
    for bad in ("-1", "abc", "1e3"):
        response = client.get(f"/api/runs/alpha/metrics?since={bad}")
        assert response.status_code == 400 and "since" in response.get_json()["error"]


def test_health_events_are_served_as_marks_for_the_loss_curve(runs: Path, client: Any) -> None:
    """Each record as the guard and a rollback write it (health.guard.HealthEvent.record, train.rollback); the
    polled slice's marks only."""

    def event(step: int, kind: str, action: str) -> dict[str, Any]:
        return {"step": step, "health_event": kind, "health_action": action, "event_loss": float("nan"),
                "event_grad_norm": None, "data_step": None, "detail": f"{kind} at {step}"}  # fmt: skip

    rollback = {"step": 9, "health_event": "rollback", "health_action": "rollback", "from_step": 9, "to_step": 6,
                "checkpoint": "step-00000006", "skipped_batches": [6, 8], "lr_scale": 1.0, "detail": "back to 6"}  # fmt: skip
    records = [event(4, "nonfinite", "skip"), event(5, "grad_norm_spike", "warn"), event(6, "loss_spike", "skip"),
               event(9, "loss_spike", "rollback"), rollback, event(11, "loss_spike", "stop")]  # fmt: skip
    with (runs / "alpha" / "metrics.jsonl").open("a") as f:
        f.write("".join(strict_json.dumps(r) + "\n" for r in records))
    marks = client.get("/api/runs/alpha/metrics?since=3").get_json()["health_marks"]
    assert [(m["step"], m["mark"], m["event"]) for m in marks] == [
        (4, "dropped", "nonfinite"), (5, "spike", "grad_norm_spike"), (6, "dropped", "loss_spike"),
        (9, "rollback", "rollback"), (11, "spike", "loss_spike"),
    ]  # fmt: skip
    assert [(m["label"], m["help"]) for m in marks] == [MARKS[m["mark"]] for m in marks]
    # drawn where it happened: a warned spike on its loss's point (the train record of the update it made, step + 1),
    # a dropped update between the updates around it, a rollback at the step it went back from
    assert [m["at"] for m in marks] == [4.5, 6.0, 6.5, 9.0, 11.5]
    assert (marks[3]["from_step"], marks[3]["to_step"], marks[3]["detail"]) == (9, 6, "back to 6")
    assert client.get("/api/runs/alpha/metrics?since=8").get_json()["health_marks"] == [marks[-1]]
    assert client.get("/api/runs/alpha/metrics?since=0").get_json()["health_marks"] == marks


def test_the_resources_view_marks_the_stragglers_of_the_latest_window(runs: Path, client: Any) -> None:
    measured = {"compute_s_per_rank": [0.01, 0.05]}
    _make_run(runs, "slow", [_train_record(1, **measured), _train_record(2, **measured, stragglers=[1])])
    _make_run(runs, "even", [_train_record(1, **measured, stragglers=[1]), _train_record(2, **measured)])
    by_name = {run["name"]: run for run in client.get("/api/system").get_json()["runs"]}
    names = ("slow", "even", "alpha")  # alpha's records measured no compute: unknown
    assert [by_name[n]["stragglers"] for n in names] == [[1], [], None]
    page = client.get("/system").text
    rows = {name: page.split(f'<tr data-run="{name}">')[1].split("</tr>")[0] for name in names}
    assert '<span class="badge straggler">rank 1</span>' in rows["slow"]
    assert 'data-field="stragglers">none</td>' in rows["even"]
    assert 'data-field="stragglers">—</td>' in rows["alpha"]


def test_corrupt_metrics_lines_are_a_warning_not_a_crash(runs: Path, client: Any) -> None:
    path = runs / "alpha" / "metrics.jsonl"
    lines = [json.dumps(_train_record(1)), "{not json", "", json.dumps(_train_record(2)), "[1, 2]",
             '{"step": 3, "train_loss"']  # fmt: skip
    path.write_text("\n".join(lines))  # the last line was cut off by a crash: no newline, and old
    old = time.time() - 120
    for written in (path, runs / "alpha" / "config.yaml"):
        os.utime(written, (old, old))
    metrics = client.get("/api/runs/alpha/metrics").get_json()
    assert [r["step"] for r in metrics["records"]] == [1, 2]
    assert metrics["run"]["warnings"] == ["3 unreadable lines in metrics.jsonl"]
    assert metrics["run"]["status"] == "stopped"
    for url in ("/", "/runs/alpha", "/runs/alpha/cost"):
        page = client.get(url)
        assert page.status_code == 200 and "3 unreadable lines in metrics.jsonl" in page.text
    (runs / "alpha" / "config.yaml").write_text("model: [unclosed\n")
    detail = client.get("/api/runs/alpha").get_json()
    assert any(w.startswith("config.yaml unreadable") for w in detail["warnings"])


@pytest.mark.parametrize(
    "bad",
    [
        '{"step": 1, "train_loss": 2.0, "peak_memory_bytes": NaN}',
        '{"step": 1, "train_loss": 2.0, "peak_memory_bytes": "Infinity"}',
        '{"step": "abc", "train_loss": 2.0}',
        '{"step": 1, "train_loss": "x"}',
        '{"step": 1, "cost_usd": "z", "projected_finish_unix": 1e30}',
        '{"step": 1, "stragglers": "rank 1"}',
        "config",
    ],
)
def test_a_value_of_the_wrong_type_in_one_run_fails_none_of_the_pages(
    runs: Path, client: Any, bad: str
) -> None:
    """A hand-edited or foreign file: the record is an unreadable line (the config value unknown), and every page,
    the other runs' included, is still served."""
    records = [_train_record(1)]
    _make_run(
        runs,
        "bad",
        records,
        config={**_config(), "train": {"max_steps": "lots"}} if bad == "config" else None,
    )
    if bad != "config":
        (runs / "bad" / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n" + bad + "\n")
    for url in ("/", "/api/runs", "/system", "/api/system", "/runs/bad", "/api/runs/bad", "/api/runs/bad/metrics",
                "/runs/bad/cost", "/api/runs/alpha"):  # fmt: skip
        assert client.get(url).status_code == 200, url
    run = client.get("/api/runs/bad").get_json()
    if bad == "config":
        assert run["max_steps"] is None
    else:
        assert run["unreadable_lines"] == 1 and run["step"] == 1


def test_a_diverged_run_is_served_as_strict_json(runs: Path, client: Any) -> None:
    """metrics.jsonl and summary.json as runs before the strict encoder wrote them (bare NaN, Infinity): every API
    response about the run still parses with JSON.parse's rules, the non-finite numbers spelled out as strings."""
    nan, inf = float("nan"), float("inf")
    records = [_train_record(1), _train_record(2, train_loss=nan, grad_norm=inf), {"step": 2, "val_loss": nan},
               _train_record(3, grad_norm=-inf)]  # fmt: skip
    run = _make_run(runs, "diverged", records)
    (run / "summary.json").write_text(json.dumps({"steps": 3, "train_loss": nan, "val_loss": nan}))
    bodies = {url: strict_json_loads(client.get(url).data)
              for url in ("/api/runs", "/api/runs/diverged", "/api/runs/diverged/metrics",
                          "/api/runs/diverged/cost", "/api/system")}  # fmt: skip
    served = bodies["/api/runs/diverged/metrics"]["records"]
    assert [(r.get("train_loss"), r.get("grad_norm"), r.get("val_loss")) for r in served] == [
        (3.99, 1.0, None), ("NaN", "Infinity", None), (None, None, "NaN"), (3.97, "-Infinity", None)]  # fmt: skip
    detail = bodies["/api/runs/diverged"]
    assert detail["summary"] == {"steps": 3, "train_loss": "NaN", "val_loss": "NaN"}
    assert (detail["train_loss"], detail["val_loss"]) == (3.97, "NaN")
    assert detail["text"]["val_loss"] == "NaN"
    assert client.get("/runs/diverged").status_code == 200


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 3-step run of a 1-layer model: its metrics, summary and committed checkpoint."""
    from gaudi3_scale.config.core import parse_overrides
    from gaudi3_scale.train import GaudiTrainer, build_run_config

    out = tmp_path_factory.mktemp("runs") / "tiny"
    args = ["--out_dir", str(out), "--train.threads", "1", "--model.num_layers", "1", "--train.max_steps", "3",
            "--train.log_every_steps", "1", "--train.val_every_steps", "0", "--optim.warmup_steps", "1"]  # fmt: skip
    GaudiTrainer(build_run_config(None, parse_overrides(args)), progress=False).fit()
    return out


def _checkpoints(client: Any, name: str) -> list[dict[str, Any]]:
    """The run's checkpoints once none is still being hashed (a request waits ~2 s, a loaded machine may not)."""
    for _ in range(60):
        rows = client.get(f"/api/runs/{name}/checkpoints").get_json()["checkpoints"]
        if all(r["status"] != "verifying" for r in rows):
            return rows
        time.sleep(0.5)
    raise AssertionError(f"checkpoints of {name} still verifying: {rows}")


@pytest.mark.integration
def test_checkpoints_show_verification_status(trained_run: Path) -> None:
    client = create_app(trained_run.parent).test_client()
    [checkpoint] = _checkpoints(client, "tiny")
    assert [checkpoint[k] for k in ("name", "latest", "status")] == ["step-00000003", True, "verified"]
    assert checkpoint["problems"] == [] and checkpoint["step"] == 3 and checkpoint["size_bytes"] > 0

    state = trained_run / "checkpoints" / "step-00000003" / "state.ckpt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    state.write_bytes(bytes(data))
    [damaged] = _checkpoints(client, "tiny")
    assert damaged["status"] == "damaged"
    assert damaged["problems"] == ["step-00000003/state.ckpt: SHA-256 does not match the manifest (corrupt)"]
    page = client.get("/runs/tiny/checkpoints").get_data(as_text=True)
    assert 'data-status="damaged"' in page and "SHA-256 does not match" in page
    overview = client.get("/api/runs/tiny").get_json()
    assert overview["status"] == "finished" and overview["step"] == 3 and overview["summary"]["steps"] == 3


class _FinishedAtOnce(ThreadPoolExecutor):
    """An executor whose futures are already done when `submit` returns: the order a fast verification and a
    slow request thread produce by chance on a loaded machine."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(fn(*args, **kwargs))
        return future


def test_a_verification_finished_before_its_callback_is_attached_does_not_deadlock(trained_run: Path) -> None:
    verifier = CheckpointVerifier(trained_run.parent, wait_s=1.0)
    verifier._pool = _FinishedAtOnce(max_workers=1)
    listed: list[list[dict[str, Any]]] = []
    worker = threading.Thread(target=lambda: listed.append(verifier.list(trained_run)[0]), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "listing checkpoints deadlocked on the verifier's lock"
    [[checkpoint]] = listed
    assert checkpoint["status"] in ("verified", "damaged")  # the other test may have flipped a byte already


def test_cost_view_numbers_equal_the_cost_module(tmp_path: Path) -> None:
    # GPT-2 124M for 200k steps of 512 × 1024 tokens (105B tokens): real money on every priced platform.
    config = _config("gpt2-124m", max_steps=200_000, batch=512)
    cost = {"cost_usd": 1234.5678, "cost_usd_per_hour": 98.32, "cost_projected_usd": 45678.9,
            "cost_budget_usd": 50000.0, "cost_budget_remaining_usd": 48765.4322, "projected_finish_unix": 2e9}  # fmt: skip
    _make_run(tmp_path, "big", [_train_record(1, **cost)], config)
    client = create_app(tmp_path).test_client()
    data = client.get("/api/runs/big/cost").get_json()

    live = data["live"]
    assert [live["accrued"], live["projected"], live["budget"]] == [usd(v) for v in (1234.5678, 45678.9, 5e4)]
    assert live["remaining"] == usd(48765.4322) and live["rate"] == f"{usd(98.32)}/h"
    tokens = 200_000 * 512 * 1024
    model = from_dict(ModelConfig, config["model"])
    expected = compare_training_cost(model, tokens, list(PLATFORMS), mfu=ASSUMED_MFU)
    comparison = data["comparison"]
    assert (comparison["tokens"], comparison["model"], comparison["error"]) == (tokens, "gpt2-124m", None)
    assert [r["platform"] for r in comparison["rows"]] == list(PLATFORMS)
    for want, got in zip(expected.rows, comparison["rows"], strict=True):
        assert got["on_demand_usd"] == want.on_demand_usd and got["train_hours"] == want.train_hours
        assert got["on_demand"] == usd(want.on_demand_usd)
        per_million = want.usd_per_million_tokens
        assert got["per_million_tokens"] == ("unknown" if per_million is None else f"{per_million:,.4f}")
        assert got["train_time"] == hours(want.train_hours) and got["fits"] == want.fits
    # … and the very strings `gaudi3 cost compare` prints for these columns
    cli_rows = cost_report.table_rows(expected)
    column = {name: cost_report._HEADERS.index(name) for name in ("on-demand", "spot", "$/1M tok")}
    for cli, got in zip(cli_rows, comparison["rows"], strict=True):
        assert [got["on_demand"], got["spot"], got["per_million_tokens"]] == [cli[i] for i in column.values()]
    shown = [r["on_demand"] for r in comparison["rows"]]
    assert "unknown" in shown and any(s.startswith("$") and s != "$0.00" for s in shown)  # both cases covered
    page = client.get("/runs/big/cost").get_data(as_text=True)
    for row in comparison["rows"]:
        assert f'<td data-field="on_demand">{row["on_demand"]}</td>' in page
    assert usd(1234.5678) in page


def test_cost_view_without_tracking_or_planned_tokens(runs: Path, client: Any) -> None:
    (runs / "alpha" / "config.yaml").write_text(yaml.safe_dump({"model": {"name": "shakespeare-char"}}))
    data = client.get("/api/runs/alpha/cost").get_json()
    assert data["live"] == {"tracked": False, "budget": "none"}
    assert "planned tokens are unknown" in data["comparison"]["error"]
    assert "Cost tracking was off" in client.get("/runs/alpha/cost").get_data(as_text=True)


def test_a_token_is_required_off_loopback(runs: Path) -> None:
    with pytest.raises(ValueError, match="needs a token"):
        create_app(runs, host="0.0.0.0")
    token, generated = resolve_token("0.0.0.0", None)
    assert generated and token is not None and len(token) >= 32
    assert resolve_token("127.0.0.1", None) == (None, False)
    assert resolve_token("::1", "a-strong-token-16") == ("a-strong-token-16", False)
    assert dashboard_cmd.TOKEN_ENV == TOKEN_ENV

    client = create_app(runs, host="0.0.0.0", token="s3cret-token-0123").test_client()
    for url in ("/", "/api/runs", "/runs/alpha", "/api/runs/alpha/metrics", "/static/charts.js"):
        refused = client.get(url)
        assert refused.status_code == 401, url
        assert "Bearer" in refused.headers["WWW-Authenticate"]
    assert client.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/api/runs?token=wrong").status_code == 401
    assert client.get("/api/runs", headers={"Authorization": "Bearer s3cret-token-0123"}).status_code == 200
    assert client.get("/api/runs?token=s3cret-token-0123").status_code == 200

    # the URL the CLI prints: the token becomes a cookie and leaves the address bar
    entered = client.get("/runs/alpha?token=s3cret-token-0123")
    assert entered.status_code == 303 and entered.headers["Location"] == "/runs/alpha"
    assert f"{COOKIE_NAME}=s3cret-token-0123" in entered.headers["Set-Cookie"]
    assert "HttpOnly" in entered.headers["Set-Cookie"]
    assert client.get("/runs/alpha").status_code == 200  # the cookie alone
    assert client.get("/api/runs/alpha/metrics?since=0").status_code == 200


def test_loopback_refuses_other_host_names(client: Any) -> None:
    assert client.get("/api/runs", headers={"Host": "127.0.0.1:8080"}).status_code == 200
    assert client.get("/api/runs", headers={"Host": "[::1]:8080"}).status_code == 200
    rebound = client.get("/api/runs", headers={"Host": "attacker.example:8080"})  # DNS rebinding
    assert rebound.status_code == 403


@pytest.mark.parametrize(
    "url",
    ["/runs/..", "/runs/%2e%2e", "/runs/%2E%2E/cost", "/runs/..%2F..%2Fetc%2Fpasswd", "/api/runs/..%2f..%2fetc%2fpasswd",
     "/api/runs/%2Fetc%2Fpasswd/metrics", "/api/runs//etc/passwd", "/runs/../../etc/passwd", "/api/runs/outside",
     "/api/runs/outside/metrics", "/runs/outside/loss.png", "/bench/..%2foutside/report.html", "/api/runs/.hidden",
     "/runs/%00", "/static/..%2f..%2fcli%2fmain.py", "/api/runs/alpha%2F..%2F..%2Fsecret"],
)  # fmt: skip
def test_run_names_cannot_leave_the_runs_directory(runs: Path, client: Any, url: str) -> None:
    secret = runs.parent / "secret"
    _make_run(runs.parent, "secret", [{"step": 1, "train_loss": 42.0, "note": "SECRET"}])
    (secret / "loss.png").write_bytes(b"SECRET")
    (runs / "outside").symlink_to(secret, target_is_directory=True)
    _make_run(runs, ".hidden", [_train_record(1)])
    response = client.get(url)
    assert response.status_code in (400, 404), (url, response.status_code)
    assert b"SECRET" not in response.data and b"def main" not in response.data


@pytest.fixture(scope="module")
def busy_port() -> Iterator[str]:
    """A port something listens on: a CLI that got past its checks fails to bind there instead of serving forever."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield str(busy.getsockname()[1])


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target, target_is_directory=target.is_dir())


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """A runs directory whose runs and benchmark hold symlinks to readable files OUTSIDE it, each full of SECRET."""
    from gaudi3_scale.checkpoint.manifest import FORMAT, FORMAT_VERSION

    outside, runs = tmp_path / "outside", tmp_path / "runs"
    outside.mkdir()
    secret = {"config.yaml": yaml.safe_dump({"model": {"name": "SECRET"}, "train": {"max_steps": 7}}),
              "summary.json": json.dumps({"device": "SECRET", "steps": 1}),
              "metrics.jsonl": json.dumps({"step": 1, "train_loss": 1.0, "note": "SECRET"}) + "\n",
              "endpoints.json": json.dumps({"url": "http://SECRET.example:9/metrics"}),
              "loss.png": "SECRET", "report.html": "<p>SECRET</p>", "latest": "SECRET\n"}  # fmt: skip
    for name, text in secret.items():
        (outside / name).write_text(text)
    (outside / "big.bin").write_bytes(b"\0" * 7777)  # its size must not show either
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "strategy": "SECRET", "tokens_seen": 4242,
                "files": {"state.ckpt": {"size_bytes": 3, "sha256": "0" * 64}}}  # fmt: skip
    (outside / "step").mkdir()
    (outside / "step" / "manifest.json").write_text(json.dumps(manifest))
    (outside / "cell").mkdir()
    (outside / "cell" / "result.json").write_text(json.dumps(_bench_result("ddp", "oom", "SECRET")))

    run = _make_run(runs, "a", [])  # real config.yaml; everything else links out
    (run / "metrics.jsonl").unlink()
    for name in ("summary.json", "metrics.jsonl", "loss.png"):
        _link(run / name, outside / name)
    _link(run / "metrics_endpoints.json", outside / "endpoints.json")
    _link(run / "metrics_endpoints" / "rank-0.json", outside / "endpoints.json")
    checkpoints = run / "checkpoints"
    _link(checkpoints / "latest", outside / "latest")
    _link(checkpoints / "step-00000001" / "manifest.json", outside / "step" / "manifest.json")
    _link(checkpoints / "step-00000002", outside / "step")
    (checkpoints / "step-00000003").mkdir()
    dotted = {**manifest, "files": {"../../../../outside/big.bin": {"size_bytes": 1, "sha256": "0" * 64}}}
    (checkpoints / "step-00000003" / "manifest.json").write_text(json.dumps({**dotted, "strategy": "ddp"}))
    (checkpoints / "step-00000004").mkdir()  # a malformed manifest: damaged, not a 500
    (checkpoints / "step-00000004" / "manifest.json").write_text(
        json.dumps({**manifest, "strategy": "ddp", "files": ["state.ckpt"]})
    )

    other = _make_run(runs, "b", [_train_record(1)])  # its config links out; its checkpoints/ too
    (other / "config.yaml").unlink()
    _link(other / "config.yaml", outside / "config.yaml")
    _link(other / "checkpoints", outside)

    bench = runs / "bench"
    (bench / "cells").mkdir(parents=True)
    (bench / "matrix.yaml").write_text("name: t\n")
    _link(bench / "cells" / "tiny.ddp.w1", outside / "cell")
    _link(bench / "report" / "report.html", outside / "report.html")
    return runs


LINKED_URLS = ["/", "/api/runs", "/runs/a", "/api/runs/a", "/api/runs/a/metrics", "/runs/a/loss.png",
               "/runs/a/checkpoints", "/api/runs/a/checkpoints", "/runs/a/cost", "/api/runs/a/cost", "/runs/b",
               "/api/runs/b", "/api/runs/b/metrics", "/runs/b/cost", "/api/runs/b/cost", "/api/runs/b/checkpoints",
               "/runs/b/checkpoints", "/system", "/api/system", "/bench/bench", "/bench/bench/report.html",
               "/api/benchmarks/bench"]  # fmt: skip


def test_links_out_of_the_runs_directory_are_never_read(planted: Path) -> None:
    client = create_app(planted).test_client()
    for url in LINKED_URLS:
        response = client.get(url)
        assert response.status_code in (200, 404), (url, response.status_code)
        assert b"SECRET" not in response.data and b"7777" not in response.data, url

    a = client.get("/api/runs/a").get_json()
    assert a["warnings"] == ["a/summary.json links outside the runs directory; not read",
                             "a/metrics.jsonl links outside the runs directory; not read"]  # fmt: skip
    assert a["summary"] is None and a["endpoints"] == [] and a["lines"] == 0
    assert client.get("/runs/a/loss.png").status_code == 404
    listed = client.get("/api/runs/a/checkpoints").get_json()
    assert listed["problem"] == "a/checkpoints/latest links outside the runs directory; not read"
    rows = {r["name"]: r for r in _checkpoints(client, "a")}
    assert {n: (r["status"], r["latest"], r["strategy"]) for n, r in rows.items()} == {
        "step-00000004": ("damaged", False, None), "step-00000003": ("damaged", False, None),
        "step-00000002": ("damaged", False, None), "step-00000001": ("damaged", False, None)}  # fmt: skip
    assert rows["step-00000004"]["size_bytes"] is None
    assert rows["step-00000001"]["problems"] == [
        "a/checkpoints/step-00000001/manifest.json links outside the runs directory; not read"
    ]
    assert rows["step-00000002"]["problems"] == [
        "a/checkpoints/step-00000002 links outside the runs directory; not read"
    ]
    assert rows["step-00000003"]["problems"] == [
        "step-00000003: malformed manifest.json: unsafe file name '../../../../outside/big.bin'"
    ]
    assert rows["step-00000004"]["problems"] == [
        "step-00000004: malformed manifest.json: 'files' is a list, not a mapping"
    ]

    b = client.get("/api/runs/b").get_json()
    assert b["config"] == {} and b["model"] is None and b["max_steps"] is None
    assert b["warnings"] == ["b/config.yaml links outside the runs directory; not read"]
    assert client.get("/api/runs/b/checkpoints").get_json() == {
        "checkpoints": [], "problem": "b/checkpoints links outside the runs directory; not read"}  # fmt: skip
    assert "b/checkpoints links outside" in client.get("/runs/b/checkpoints").text

    bench = client.get("/api/benchmarks/bench").get_json()
    assert bench["cells"] == [] and bench["report"] is None
    assert bench["problem"] == "bench/cells/tiny.ddp.w1 links outside the runs directory; not read"
    assert client.get("/bench/bench/report.html").status_code == 404


def test_links_inside_the_runs_directory_are_followed(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    shared = _make_run(runs, "shared", [_train_record(1), _train_record(2)])
    run = runs / "alias"
    run.mkdir()
    _link(run / "metrics.jsonl", shared / "metrics.jsonl")  # a link that stays inside is fine
    data = create_app(runs).test_client().get("/api/runs/alias/metrics").get_json()
    assert [r["step"] for r in data["records"]] == [1, 2] and data["run"]["warnings"] == []


@pytest.mark.parametrize(
    ("token", "words"),
    [("", "0 characters"), ("x", "1 characters; a token needs 16"), ("fifteen-chars-1", "15 characters"),
     ("sixteen chars 12", "character ' ' is not allowed"), ('sixteen-chars-12"', "character '\"'"),
     ("sixteen-chars;12", "character ';'"), ("sixteen-chärs-12", "character 'ä'")],
)  # fmt: skip
def test_a_weak_token_is_refused_with_one_line(
    gaudi3_cli: Callable[..., CliResult], runs: Path, busy_port: str, token: str, words: str
) -> None:
    for host in ("0.0.0.0", "127.0.0.1"):  # a token given is checked wherever it is bound
        code, out, err = gaudi3_cli("dashboard", "--runs", str(runs), "--host", host, "--port", busy_port,
                                    "--token", token)  # fmt: skip
        assert code == 2 and out == "" and err.count("\n") == 1, (token, out, err)
        assert f"--token (or {TOKEN_ENV}): " in err and words in err, err
    with pytest.raises(ValueError, match="token: "):
        create_app(runs, host="0.0.0.0", token=token)


def test_the_token_from_the_environment_is_checked_too(
    gaudi3_cli: Callable[..., CliResult], runs: Path, busy_port: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "short")
    code, _, err = gaudi3_cli("dashboard", "--runs", str(runs), "--host", "0.0.0.0", "--port", busy_port)
    assert code == 2 and "5 characters; a token needs 16" in err


def test_tokens_never_reach_the_logs(runs: Path, caplog: pytest.LogCaptureFixture) -> None:
    token = "right-token-0123456789"
    caplog.set_level(logging.INFO, logger="werkzeug")
    server = build_server(runs, "127.0.0.1", 0, token)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.port}"
    secrets = ["wrong-token-typo-111", "other-guess-2222222", "third-guess-3333333", token]
    urls = [(f"/api/runs?since=1&token={secrets[0]}", 401), (f"/runs/alpha?tok%65n={secrets[1]}", 401),
            (f"/api/runs?TOKEN={secrets[2]}&x=1", 401), (f"/api/runs/nope?token={token}", 404),
            (f"/api/no/such?token={token}", 404), (f"/api/runs/alpha/metrics?since=x&token={token}", 400)]  # fmt: skip
    try:
        for url, status in urls:
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(base + url, timeout=10)
            assert refused.value.code == status, url
    finally:
        server.shutdown()
        thread.join(timeout=10)
    logged = caplog.text
    assert logged.count("[redacted]") >= len(urls), (
        logged
    )  # every refused request was logged, without its token
    for secret in secrets:
        assert secret not in logged, logged


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
def test_read_only(client: Any, method: str) -> None:
    for url in ("/", "/api/runs", "/api/runs/alpha/metrics", "/no/such/page"):
        response = client.open(url, method=method)
        assert response.status_code == 405, (method, url)
        assert response.headers["Allow"] == "GET, HEAD"
    assert client.head("/api/runs").status_code == 200


def test_cli_bad_input_is_one_line_exit_2(gaudi3_cli: Callable[..., CliResult], runs: Path) -> None:
    for args, fragment in (
        (["--runs", str(runs), "--port", "70000"], "--port: expected a TCP port 0..65535"),
        (["--runs", str(runs), "--port", "-1"], "--port"),
        (["--runs", str(runs), "--port", "http"], "--port"),
        (["--runs", str(runs / "nope")], "--runs:"),
    ):
        code, _, err = gaudi3_cli("dashboard", *args)
        assert code == 2 and err.count("\n") == 1 and fragment in err, (args, err)
        assert "Traceback" not in err


@pytest.fixture
def served(runs: Path) -> Iterator[str]:
    server = build_server(runs, "127.0.0.1", 0, None)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.port}"
    server.shutdown()
    thread.join(timeout=10)


def test_served_by_werkzeug_threaded_server(served: str, runs: Path) -> None:
    with urllib.request.urlopen(f"{served}/api/runs", timeout=10) as response:
        assert json.loads(response.read())["runs"][0]["name"] == "alpha"
    with urllib.request.urlopen(f"{served}/static/charts.js", timeout=10) as response:
        script = response.read().decode()
    assert "class LineChart" in script and "https://" not in script  # our own code, nothing from a CDN
    with pytest.raises(UserInputError, match="cannot listen"):
        build_server(runs, "127.0.0.1", int(served.rsplit(":", 1)[1]), None)
