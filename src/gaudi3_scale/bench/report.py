"""`gaudi3 benchmark report DIR…`: benchmark results → results.csv, four PNG plots, report.md and report.html.

Each DIR is one *set* of results (one machine, usually one `gaudi3 benchmark run` output directory), labelled with
its directory's name or a label given for it. Every `*.json` under DIR whose `schema` is the result schema
(`bench.schema`) is read; other JSON is ignored. A damaged result is an error naming it: a file that claims the
schema, and any file named as the runner names results (`cells/<id>/result.json`, `benchmark_result.json`), which a
cut-short copy no longer shows to be one (the schema string sits near the end of the runner's sorted keys).
The runner leaves two copies of a cell (`cells/<id>/result.json` and the rank-0 copy in `run/`); the runner's
`result.json` wins because only it carries scaling efficiency, else the latest by `created`.

Every number in the reports is formatted from the row written to the CSV, so the two cannot disagree. The HTML is
self-contained (plots as data URIs, inline CSS, no scripts) and escapes every string from the result files. Prices
come from the command line until a cost catalog exists, and the reports say so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from gaudi3_scale.bench.plots import PLOTS, group_rows, write_plots
from gaudi3_scale.bench.result import RESULT_FILE, WORKLOAD_FIELDS
from gaudi3_scale.bench.schema import RESULT_SCHEMA, validate_result
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.config.files import parse_json
from gaudi3_scale.document import Block, Image, Section, Table, to_html, to_markdown

__all__ = [
    "PRICE_NOTE",
    "LabelledResult",
    "ReportFiles",
    "ResultScan",
    "load_results",
    "scan_results",
    "write_report",
]

PRICE_NOTE = "prices given on the command line"
_INSTALL = "pip install 'gaudi3-scale[report]'"
_GIB = 2**30
_DAMAGED = "a damaged benchmark result: run its cell again, or delete the file"
_CELL_COLUMNS = ("id", "matrix", "model", "strategy", "world_size", "nnodes", "micro_batch_size", "global_batch_size",
                 "accumulation", "context_length", "precision", "data")  # fmt: skip
_METRIC_COLUMNS = ("tokens_per_s", "samples_per_s", "step_time_mean_s", "step_time_p50_s", "step_time_p95_s",
                   "peak_memory_bytes", "peak_memory_gib", "h2d_gbps", "mean_loss", "mfu", "scaling_efficiency",
                   "cost_usd_per_million_tokens")  # fmt: skip
_COLUMNS = ("set", "hardware", *_CELL_COLUMNS, "status", "reason", *_METRIC_COLUMNS, "git_commit", "date")
_ROW_ORDER = ("model", "strategy", "world_size", "micro_batch_size", "precision", "id")
_AXES = ("model", "strategy", "world_size", "micro_batch_size", "precision")  # what a cell's id names
# Cells of two sets compare only where they measured the same work: the same axes and workload (`WORKLOAD_FIELDS`).
_COMPARE_KEY = (*_AXES, *WORKLOAD_FIELDS)
# A workload field is a column of the tables where rows of the same axes differ in it (else they read as one cell).
_WORKLOAD_HEADERS = {"nnodes": "nodes", "global_batch_size": "global batch", "accumulation": "accumulation",
                     "context_length": "context", "data": "data"}  # fmt: skip
# How the reports show a value (the CSV keeps it whole); anything not listed is shown with str().
_FORMATS = {"tokens_per_s": "{:,.1f}", "samples_per_s": "{:,.2f}", "step_time_p50_s": "{:.4f}",
            "step_time_p95_s": "{:.4f}", "peak_memory_gib": "{:.2f}", "mfu": "{:.2%}", "scaling_efficiency": "{:.2f}",
            "cost_usd_per_million_tokens": "{:,.4f}", "price_usd_per_hour": "{:,.2f}", "ratio": "{:.2f}"}  # fmt: skip
_RESULT_TABLE = (("strategy", "strategy"), ("ranks", "world_size"), ("model", "model"),
                 ("micro-batch", "micro_batch_size"), ("precision", "precision"), ("tokens/s", "tokens_per_s"),
                 ("samples/s", "samples_per_s"), ("p50 step (s)", "step_time_p50_s"),
                 ("p95 step (s)", "step_time_p95_s"), ("peak GiB/rank", "peak_memory_gib"), ("MFU", "mfu"),
                 ("scaling efficiency", "scaling_efficiency"), ("status", "status"))  # fmt: skip

_Row: TypeAlias = dict[str, Any]


@dataclass(frozen=True)
class LabelledResult:
    label: str  # the set it came from: its directory's name, or the label given for that directory
    path: Path  # the file it was read from
    result: dict[str, Any]  # a valid version-1 result (bench.schema)


@dataclass(frozen=True)
class ReportFiles:
    csv: Path
    markdown: Path
    html: Path
    plots: list[Path]


# ---- loading -------------------------------------------------------------------------------------------------------


def load_results(dirs: Sequence[Path]) -> list[LabelledResult]:
    """Every result under each directory, labelled with the directory's name (see the module docstring)."""
    return _load_sets(dirs, [_dir_label(Path(d)) for d in dirs])


def _dir_label(directory: Path) -> str:
    return directory.name if directory.name not in ("", "..") else directory.resolve().name or str(directory)


def _load_sets(dirs: Sequence[Path], labels: Sequence[str]) -> list[LabelledResult]:
    if not dirs:
        raise UserInputError("no benchmark result directories given")
    if len(labels) != len(dirs):
        raise UserInputError(
            f"{len(labels)} labels given for {len(dirs)} result directories; give one per directory"
        )
    seen: dict[str, Path] = {}
    for directory, label in zip(dirs, labels, strict=True):
        if not label.strip():
            raise UserInputError(f"{directory}: the set label must not be empty")
        if label in seen:
            raise UserInputError(f"result sets {seen[label]} and {directory} are both labelled {label!r}; "
                                 f"give each its own label")  # fmt: skip
        seen[label] = Path(directory)
    return [item for label, directory in seen.items() for item in _load_set(directory, label)]


@dataclass(frozen=True)
class ResultScan:
    items: list[LabelledResult]  # one per cell: the copy that wins (see the module docstring)
    damaged: list[tuple[Path, str]]  # a result file that is not a valid result, and the line that says why


def scan_results(directory: Path, label: str | None = None) -> ResultScan:
    """Every result under `directory`, and every damaged one beside them (the dashboard shows both); the set is
    labelled with `label`, default the directory's name. A directory that is missing, or holds neither, is an
    error."""
    label = _dir_label(directory) if label is None else label
    if not directory.is_dir():
        raise UserInputError(f"{directory}: not a directory of benchmark results")
    best: dict[str, tuple[tuple[bool, str], LabelledResult]] = {}
    damaged: list[tuple[Path, str]] = []
    for path in sorted(directory.rglob("*.json")):
        try:
            result = _read_if_result(path)
        except UserInputError as exc:
            damaged.append((path, str(exc)))
            continue
        if result is None:
            continue
        rank = (path.name == "result.json", result["created"])
        cell_id = result["cell"]["id"]
        if cell_id not in best or rank > best[cell_id][0]:
            best[cell_id] = (rank, LabelledResult(label=label, path=path, result=result))
    if not best and not damaged:
        raise UserInputError(
            f"{directory}: no benchmark results found (JSON files with schema {RESULT_SCHEMA!r})"
        )
    return ResultScan(items=[item for _, item in best.values()], damaged=damaged)


def _load_set(directory: Path, label: str) -> list[LabelledResult]:
    scan = scan_results(directory, label)
    if scan.damaged:  # a report without the cell would look complete
        raise UserInputError(scan.damaged[0][1])
    return scan.items


def _read_if_result(path: Path) -> dict[str, Any] | None:
    """The valid result in `path`; None for JSON of another kind; UserInputError for a damaged result."""
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise UserInputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    # Named as the runner and a cell's rank 0 name results: one cut short must not pass for other JSON.
    named = path.name == RESULT_FILE or (path.name == "result.json" and path.parent.parent.name == "cells")
    if RESULT_SCHEMA not in text and not named:
        return None  # cheap: other JSON (configs, manifests, tokenizers) is never parsed
    try:
        obj = parse_json(text, where=str(path) if named else f"{path} (names the benchmark result schema)",
                         expect=None)  # fmt: skip
    except UserInputError as exc:
        raise UserInputError(f"{exc}; {_DAMAGED}") from None
    if not named and (not isinstance(obj, dict) or obj.get("schema") != RESULT_SCHEMA):
        return None
    return validate_result(obj, str(path))


# ---- rows: the CSV, and the values every report shows ---------------------------------------------------------------


def _text(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)


def _hardware(env: dict[str, Any]) -> str | None:
    cuda = env.get("cuda")
    return _text(cuda.get("device") if isinstance(cuda, dict) else None) or _text(env.get("cpu"))


def _row(item: LabelledResult, price_usd_per_hour: float | None) -> _Row:
    result, env = item.result, item.result["environment"]
    metrics = result["metrics"] or {}  # null unless the cell is ok
    step = metrics.get("step_time_s") or {}
    peak = metrics.get("peak_memory_bytes")
    tokens_per_s = metrics.get("tokens_per_s")
    cost = None
    if price_usd_per_hour is not None and tokens_per_s is not None:
        cost = price_usd_per_hour / 3600 / tokens_per_s * 1e6  # the whole machine's USD/s over its tokens/s
    return {
        "set": item.label,
        "hardware": _hardware(env),
        **{name: result["cell"][name] for name in _CELL_COLUMNS},
        "status": result["status"],
        "reason": result["reason"],
        "tokens_per_s": tokens_per_s,
        "samples_per_s": metrics.get("samples_per_s"),
        "step_time_mean_s": step.get("mean"),
        "step_time_p50_s": step.get("p50"),
        "step_time_p95_s": step.get("p95"),
        "peak_memory_bytes": peak,
        "peak_memory_gib": None if peak is None else peak / _GIB,
        **{name: metrics.get(name) for name in ("h2d_gbps", "mean_loss", "mfu", "scaling_efficiency")},
        "cost_usd_per_million_tokens": cost,
        "git_commit": _text(env.get("git_commit")),
        "date": result["created"],
    }


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "—"
    return _FORMATS[key].format(value) if key in _FORMATS else str(value)


def _write_csv(rows: Sequence[_Row], path: Path) -> None:
    try:
        import pandas as pd
    except ImportError:
        raise UserInputError(
            f"the benchmark report needs pandas, which is not installed; {_INSTALL}"
        ) from None
    frame = pd.DataFrame(list(rows), columns=list(_COLUMNS))
    # nullable integers: the peak stays an integer beside the blanks of failed cells
    frame["peak_memory_bytes"] = frame["peak_memory_bytes"].astype("Int64")
    frame.to_csv(path, index=False)


def _checked_prices(prices: Mapping[str, float], set_labels: Sequence[str]) -> dict[str, float]:
    for label, price in prices.items():
        if label not in set_labels:
            raise UserInputError(f"a price is given for set {label!r}, which is not one of the sets: "
                                 f"{', '.join(set_labels)}")  # fmt: skip
        if not (math.isfinite(price) and price > 0):
            raise UserInputError(
                f"the price of set {label!r} must be a positive number of USD per hour, got {price}"
            )
    return dict(prices)


# ---- plots ---------------------------------------------------------------------------------------------------------


# ---- the document: built once, rendered as Markdown and as HTML ---------------------------------------------------


def _distinct(values: Iterable[Any]) -> str:
    return ", ".join(dict.fromkeys(str(v) for v in values if v is not None and v != "")) or "—"


def _machines(
    items: Sequence[LabelledResult], set_labels: Sequence[str], prices: Mapping[str, float]
) -> Table:
    headers = ["set", "hardware", "CPUs", "torch", "git commit", "date", "cells ok"]
    if prices:
        headers.append(f"USD/h ({PRICE_NOTE})")
    rows = []
    for label in set_labels:
        results = [item.result for item in items if item.label == label]
        envs = [r["environment"] for r in results]
        torch_versions = (
            e["packages"].get("torch") if isinstance(e.get("packages"), dict) else None for e in envs
        )
        dates = sorted(r["created"][:10] for r in results)
        row = [label, _distinct(map(_hardware, envs)), _distinct(e.get("cpu_count") for e in envs),
               _distinct(torch_versions), _distinct(e.get("git_commit") for e in envs),
               dates[0] if dates[0] == dates[-1] else f"{dates[0]} … {dates[-1]}",
               f"{sum(r['status'] == 'ok' for r in results)} of {len(results)}"]  # fmt: skip
        if prices:
            row.append(_fmt("price_usd_per_hour", prices.get(label)))
        rows.append(row)
    return Table(headers, rows)


def _varying(rows: Sequence[_Row]) -> list[tuple[str, str]]:
    """(header, key) of each workload field in which rows of the same axes differ (they would read as one cell)."""
    by_axes = group_rows(rows, lambda r: tuple(r[k] for k in _AXES))
    return [(_WORKLOAD_HEADERS.get(key, key), key) for key in WORKLOAD_FIELDS
            if any(len({str(r[key]) for r in group}) > 1 for group in by_axes.values())]  # fmt: skip


def _results(rows: Sequence[_Row], many_sets: bool, priced: bool) -> Table:
    at = [key for _, key in _RESULT_TABLE].index("precision") + 1
    columns = [("set", "set")] * many_sets + [*_RESULT_TABLE[:at], *_varying(rows), *_RESULT_TABLE[at:]]
    if priced:
        columns.append(("USD per M tokens", "cost_usd_per_million_tokens"))
    return Table([h for h, _ in columns], [[_fmt(key, row[key]) for _, key in columns] for row in rows])


def _failures(rows: Sequence[_Row], many_sets: bool) -> list[Block]:
    failed = [r for r in rows if r["status"] != "ok"]
    if not failed:
        return ["Every cell finished."]
    where = (lambda r: f"{r['set']} · {r['id']}") if many_sets else (lambda r: r["id"])
    return [[f"{where(r)} — {r['status']}: {r['reason'] or '(no reason recorded)'}" for r in failed]]


def _comparison(rows: Sequence[_Row], set_labels: Sequence[str], prices: Mapping[str, float]) -> list[Block]:
    reference = set_labels[0]
    by_key = group_rows((r for r in rows if r["status"] == "ok"), lambda r: tuple(r[k] for k in _COMPARE_KEY))
    shared = {key: {r["set"]: r for r in group} for key, group in by_key.items()}
    shared = {key: sets for key, sets in shared.items() if len(sets) > 1}
    intro = (f"tokens/s of each configuration (model, strategy, ranks, micro-batch, precision, and the work: nodes, "
             f"global batch, accumulation, context length, data) that ran in more than one set, and its ratio to set "
             f"{reference}.")  # fmt: skip
    if prices:
        listed = ", ".join(f"{label} {_fmt('price_usd_per_hour', p)} USD/h" for label, p in prices.items())
        intro += f" Cost in USD per million tokens at the {PRICE_NOTE}: {listed}."
    if not shared:
        return [intro, "No configuration ran in more than one set."]
    workload = _varying([r for sets in shared.values() for r in sets.values()])
    headers = ["model", "strategy", "ranks", "micro-batch", "precision", *(h for h, _ in workload)]
    for label in set_labels:
        headers += [f"tokens/s {label}"] + [f"{label} ÷ {reference}"] * (label != reference)
        headers += [f"USD per M tokens {label}"] * (label in prices)
    table = []
    for key, sets in shared.items():
        named = dict(zip(_COMPARE_KEY, key, strict=True))
        line = [str(named[k]) for k in (*_AXES, *(k for _, k in workload))]
        base = sets.get(reference)
        for label in set_labels:
            row = sets.get(label)
            if row is None:  # this configuration did not run (or failed) in this set
                line += ["—"] * (1 + (label != reference) + (label in prices))
                continue
            line.append(_fmt("tokens_per_s", row["tokens_per_s"]))
            if label != reference:
                line.append(_fmt("ratio", row["tokens_per_s"] / base["tokens_per_s"] if base else None))
            if label in prices:
                line.append(_fmt("cost_usd_per_million_tokens", row["cost_usd_per_million_tokens"]))
        table.append(line)
    return [intro, Table(headers, table)]


def _sections(
    items: Sequence[LabelledResult],
    rows: Sequence[_Row],
    set_labels: Sequence[str],
    prices: Mapping[str, float],
    plots: Sequence[Path],
) -> list[Section]:
    many_sets = len(set_labels) > 1
    sections: list[Section] = [
        ("Machines", [_machines(items, set_labels, prices)]),
        ("Results", [_results(rows, many_sets, bool(prices))]),
        ("Failed, out-of-memory and timed-out cells", _failures(rows, many_sets)),
    ]
    if many_sets:
        sections.append(("Comparison across sets", _comparison(rows, set_labels, prices)))
    sections.append(("Plots", [Image(path, PLOTS[path.name]) for path in plots]))
    return sections


# ---- the entry point -----------------------------------------------------------------------------------------------


def write_report(
    dirs: Sequence[Path],
    out_dir: Path,
    *,
    labels: Sequence[str] | None = None,
    prices_usd_per_hour: Mapping[str, float] | None = None,
    title: str = "gaudi3-scale benchmark",
) -> ReportFiles:
    """Read the result sets in `dirs`, write results.csv, the plots, report.md and report.html into `out_dir`.

    `labels` names the sets (one per directory; default: the directories' names). `prices_usd_per_hour` maps a set
    label to the price of the whole machine it ran on; its ok cells then get a cost per million tokens.
    """
    set_labels = list(labels) if labels is not None else [_dir_label(Path(d)) for d in dirs]
    items = _load_sets(dirs, set_labels)
    prices = _checked_prices(prices_usd_per_hour or {}, set_labels)
    order = {label: i for i, label in enumerate(set_labels)}
    rows = sorted(
        (_row(item, prices.get(item.label)) for item in items),
        key=lambda r: (order[r["set"]], *(r[k] for k in _ROW_ORDER)),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "results.csv"
    _write_csv(rows, csv_path)  # first: a missing pandas fails before anything else is written
    files = ReportFiles(
        csv=csv_path,
        markdown=out_dir / "report.md",
        html=out_dir / "report.html",
        plots=write_plots(rows, out_dir, len(set_labels) > 1),
    )
    sections = _sections(items, rows, set_labels, prices, files.plots)
    files.markdown.write_text(to_markdown(title, sections), encoding="utf-8")
    files.html.write_text(to_html(title, sections), encoding="utf-8")
    return files
