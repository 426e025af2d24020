"""The Flask app: pages (server-rendered, with small scripts that poll) and the JSON API they read.

Pages                                   API (JSON)
  /                     run list          /api/runs
  /runs/NAME            live training     /api/runs/NAME, /api/runs/NAME/metrics?since=LINE (+ health marks,
                                          + eta: the forecast's predicted line and finish beside the live ETA)
  /runs/NAME/checkpoints                  /api/runs/NAME/checkpoints
  /runs/NAME/cost       cost and TCO      /api/runs/NAME/cost
  /system               resources         /api/system
  /bench/NAME           benchmark report  /api/benchmarks/NAME
Everything is read from `--runs DIR`, through `files` (nothing outside it); nothing is written (see `security`
for who may read).
All JSON, the API's and that in the pages, is strict (`json_provider`): a diverged run's NaN is the string "NaN".
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import gaudi3_scale.dashboard.formatting as formatting
from gaudi3_scale.dashboard.bench import benchmark_cells, report_html
from gaudi3_scale.dashboard.checkpoints import CheckpointVerifier
from gaudi3_scale.dashboard.costs import CostStore, live_cost
from gaudi3_scale.dashboard.eta import run_eta
from gaudi3_scale.dashboard.files import OutsideRuns, has_file, real_file
from gaudi3_scale.dashboard.runs import RunStore, config_section
from gaudi3_scale.dashboard.security import install_guards, is_loopback, token_problem
from gaudi3_scale.dashboard.system import host_snapshot, metrics_endpoints
from gaudi3_scale.health.marks import health_marks

if TYPE_CHECKING:
    from flask import Flask, Response

__all__ = ["POLL_INTERVAL_MS", "create_app"]

POLL_INTERVAL_MS = 1000  # the live view's metrics poll
_REPORT_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; frame-ancestors 'self'; sandbox"


def create_app(runs_dir: Path, *, host: str = "127.0.0.1", token: str | None = None) -> Flask:
    """The dashboard over `runs_dir`, as served on `host`: off loopback, `token` is required (see `security`)."""
    from flask import Flask

    from gaudi3_scale.dashboard.json_provider import StrictJSONProvider

    if not is_loopback(host) and token is None:
        raise ValueError(f"a dashboard bound to {host} needs a token")  # the CLI generates one
    if token is not None and (problem := token_problem(token)) is not None:
        raise ValueError(f"token: {problem}")
    app = Flask(__name__)
    # Set before anything builds the Jinja environment, which takes the provider's `dumps` for `tojson`.
    app.json = StrictJSONProvider(app)
    app.url_map.merge_slashes = False  # "//etc" is a 404, not a redirect to "/etc"
    install_guards(app, token)
    for name in ("usd", "gib", "percent", "loss", "rate", "hours", "when"):
        app.add_template_filter(getattr(formatting, name), name)
    store = RunStore(runs_dir)
    ctx = _Context(store, CheckpointVerifier(store.directory), CostStore())
    _add_pages(app, ctx)
    _add_api(app, ctx)
    _add_errors(app)
    host_snapshot()  # psutil measures CPU between calls: start the clock so the first page shows a real figure
    return app


class _Context:
    """What the views share: the runs directory and the caches over it."""

    def __init__(self, store: RunStore, verifier: CheckpointVerifier, costs: CostStore) -> None:
        self.store, self.verifier, self.costs = store, verifier, costs

    def run_dir(self, name: str) -> Path:
        from flask import abort

        path = self.store.resolve(name, "run")
        if path is None:
            abort(404, f"no run named {name!r} in the runs directory")
        return path

    def bench_dir(self, name: str) -> Path:
        from flask import abort

        path = self.store.resolve(name, "benchmark")
        if path is None:
            abort(404, f"no benchmark named {name!r} in the runs directory")
        return path

    def overview(self, name: str, run_dir: Path) -> dict[str, Any]:
        run = self.store.overview(name, run_dir)
        return {**run, "text": formatting.overview_text(run)}

    def eta(self, run_dir: Path, run: dict[str, Any]) -> dict[str, Any]:
        """The progress view (`eta`) of the run whose `overview` is `run`."""
        plan, problem = self.store.plan(run_dir)
        summary, _ = self.store.summary(run_dir)
        return run_eta(plan, problem, self.store.metrics_view(run_dir), summary, max_steps=run["max_steps"],
                       status=run["status"])  # fmt: skip

    def runs(self) -> list[dict[str, Any]]:
        return [self.overview(n, p) for n, p, kind in self.store.children() if kind == "run"]

    def benchmarks(self) -> list[dict[str, Any]]:
        return [{"name": n, "report": self.report(p) is not None}
                for n, p, kind in self.store.children() if kind == "benchmark"]  # fmt: skip

    def cost(self, run_dir: Path) -> dict[str, Any]:
        config, _ = self.store.config(run_dir)
        view = self.store.metrics_view(run_dir)
        comparison = self.costs.comparison(run_dir, config)
        return {"live": live_cost(view.latest_cost, config), "comparison": comparison}

    def resources(self) -> list[dict[str, Any]]:
        root = self.store.directory
        return [{**run, "endpoints": metrics_endpoints(root, root / run["name"])} for run in self.runs()]

    def endpoints(self, run_dir: Path) -> list[str]:
        return metrics_endpoints(self.store.directory, run_dir)

    def report(self, bench_dir: Path) -> Path | None:
        return report_html(self.store.directory, bench_dir)

    def cells(self, bench_dir: Path) -> tuple[list[dict[str, Any]], str | None]:
        return benchmark_cells(self.store.directory, bench_dir)

    def has_file(self, path: Path) -> bool:
        return has_file(self.store.directory, path)

    def send_inside(self, path: Path, mimetype: str) -> Response:
        """A file of the runs directory, sent from its real path (a symlink out of it is a 404)."""
        from flask import abort, send_file

        try:
            real = real_file(self.store.directory, path)
        except OutsideRuns as exc:
            abort(404, str(exc))
        if real is None:
            abort(404, f"{path.name} not found")
        return send_file(real, mimetype=mimetype)


def _add_pages(app: Flask, ctx: _Context) -> None:
    from flask import render_template

    @app.get("/")
    def index() -> str:
        return render_template("index.html", runs=ctx.runs(), benchmarks=ctx.benchmarks(),
                               unlisted=ctx.store.unlisted(), runs_dir=ctx.store.directory,
                               host=host_snapshot())  # fmt: skip

    @app.get("/runs/<name>")
    def run_page(name: str) -> str:
        run_dir = ctx.run_dir(name)
        config, _ = ctx.store.config(run_dir)
        summary, _ = ctx.store.summary(run_dir)
        run = ctx.overview(name, run_dir)
        return render_template("run.html", run=run, config=config, summary=summary, section=config_section,
                               has_loss_png=ctx.has_file(run_dir / "loss.png"), eta=ctx.eta(run_dir, run),
                               poll_ms=POLL_INTERVAL_MS)  # fmt: skip

    @app.get("/runs/<name>/loss.png")
    def loss_png(name: str) -> Response:
        return ctx.send_inside(ctx.run_dir(name) / "loss.png", "image/png")

    @app.get("/runs/<name>/checkpoints")
    def checkpoints_page(name: str) -> str:
        run_dir = ctx.run_dir(name)
        rows, problem = ctx.verifier.list(run_dir)
        return render_template("checkpoints.html", run=ctx.overview(name, run_dir), checkpoints=rows,
                               problem=problem, verifying=any(r["status"] == "verifying" for r in rows))  # fmt: skip

    @app.get("/runs/<name>/cost")
    def cost_page(name: str) -> str:
        run_dir = ctx.run_dir(name)
        return render_template("cost.html", run=ctx.overview(name, run_dir), **ctx.cost(run_dir))

    @app.get("/system")
    def system_page() -> str:
        runs = ctx.resources()
        return render_template("system.html", host=host_snapshot(), runs=runs, poll_ms=POLL_INTERVAL_MS)

    @app.get("/bench/<name>")
    def bench_page(name: str) -> str:
        directory = ctx.bench_dir(name)
        cells, problem = ctx.cells(directory)
        return render_template("bench.html", name=name, has_report=ctx.report(directory) is not None,
                               cells=cells, problem=problem)  # fmt: skip

    @app.get("/bench/<name>/report.html")
    def bench_report(name: str) -> Response:
        from flask import abort

        path = ctx.report(ctx.bench_dir(name))
        if path is None:
            abort(404, f"benchmark {name!r} has no report.html (run `gaudi3 benchmark report`)")
        response = ctx.send_inside(path, "text/html")
        response.headers["Content-Security-Policy"] = _REPORT_CSP  # inline CSS and data: plots, never scripts
        return response


def _since() -> int:
    from flask import abort, request

    text = request.args.get("since", "0")
    if not text.isdecimal() or len(text) > 12:
        abort(400, f"since: expected a line offset (a non-negative integer), got {text!r}")
    return int(text)


def _add_api(app: Flask, ctx: _Context) -> None:
    from flask import jsonify

    @app.get("/api/runs")
    def api_runs() -> Response:
        return jsonify(runs_dir=str(ctx.store.directory), runs=ctx.runs(), benchmarks=ctx.benchmarks(),
                       unlisted=ctx.store.unlisted())  # fmt: skip

    @app.get("/api/runs/<name>")
    def api_run(name: str) -> Response:
        run_dir = ctx.run_dir(name)
        config, _ = ctx.store.config(run_dir)
        summary, _ = ctx.store.summary(run_dir)
        run = ctx.overview(name, run_dir)
        return jsonify(**run, config=config, summary=summary, endpoints=ctx.endpoints(run_dir),
                       eta=ctx.eta(run_dir, run))  # fmt: skip

    @app.get("/api/runs/<name>/metrics")
    def api_metrics(name: str) -> Response:
        """Records on lines `since` … `next` - 1; poll again with since=next&file=FILE. `file` names this copy of
        metrics.jsonl. `reset`: the file was replaced (another `file`, or since > its lines), or the caller is too
        far behind (`downsampled`), so these are all of its records and the caller starts over. `downsampled`:
        a long file's lines before its last ones are sent as `series` keeps them (each chart's shape, extremes
        and health events; at most a few thousand records), not each. `health_marks`: how the loss chart marks
        the health events among them (`health.marks`). `eta`: the progress chart's predicted line and the
        finish lines (`dashboard.eta`)."""
        from flask import request

        run_dir = ctx.run_dir(name)
        since = _since()
        view = ctx.store.metrics_view(run_dir)
        file = request.args.get("file")
        reset = since > view.count or (file is not None and file != view.file_id)
        records, downsampled = view.records(0 if reset else since)
        reset = reset or (downsampled and since > 0)
        run = ctx.overview(name, run_dir)
        return jsonify(since=since, next=view.count, file=view.file_id, reset=reset, downsampled=downsampled,
                       records=records, health_marks=health_marks(records), run=run,
                       eta=ctx.eta(run_dir, run))  # fmt: skip

    @app.get("/api/runs/<name>/checkpoints")
    def api_checkpoints(name: str) -> Response:
        rows, problem = ctx.verifier.list(ctx.run_dir(name))
        return jsonify(checkpoints=rows, problem=problem)

    @app.get("/api/runs/<name>/cost")
    def api_cost(name: str) -> Response:
        return jsonify(**ctx.cost(ctx.run_dir(name)))

    @app.get("/api/system")
    def api_system() -> Response:
        return jsonify(host=host_snapshot(), runs=ctx.resources())

    @app.get("/api/benchmarks/<name>")
    def api_benchmark(name: str) -> Response:
        directory = ctx.bench_dir(name)
        cells, problem = ctx.cells(directory)
        report = f"/bench/{name}/report.html" if ctx.report(directory) is not None else None
        return jsonify(name=name, report=report, cells=cells, problem=problem)


def _add_errors(app: Flask) -> None:
    from flask import jsonify, render_template, request
    from werkzeug.exceptions import HTTPException

    @app.errorhandler(HTTPException)
    def _error(exc: HTTPException) -> tuple[Any, int]:
        code = exc.code or 500
        message = exc.description or exc.name
        if request.path.startswith("/api/"):
            return jsonify(error=message), code
        return render_template("error.html", code=code, name=exc.name, message=message), code
