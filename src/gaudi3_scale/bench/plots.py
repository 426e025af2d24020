"""The benchmark report's PNG plots (matplotlib's object API, no pyplot state): throughput and scaling efficiency vs
ranks per strategy, peak memory per rank, the step-time distribution. Failed cells are listed in the reports, not
plotted. Rows are `bench.report`'s CSV rows (dicts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

__all__ = ["PLOTS", "group_rows", "write_plots"]

_Row: TypeAlias = dict[str, Any]
_GIB = 2**30

PLOTS = {  # file → title
    "throughput_vs_world_size.png": "Throughput vs ranks",
    "scaling_efficiency.png": "Scaling efficiency vs ranks",
    "peak_memory.png": "Peak memory per rank",
    "step_time_distribution.png": "Step time per cell: bar at p50, whisker to p95",
}


def group_rows(rows: Iterable[_Row], key: Callable[[_Row], Any]) -> dict[Any, list[_Row]]:
    groups: dict[Any, list[_Row]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    return groups


@dataclass(frozen=True)
class _Series:
    """A line (or bar colour) per strategy; micro-batch and precision join the name when the cells vary in them."""

    detailed: bool
    colors: dict[str, str]

    def label(self, row: _Row) -> str:
        name = (
            f"{row['strategy']} mb{row['micro_batch_size']} {row['precision']}"
            if self.detailed
            else row["strategy"]
        )
        return _plain(name)


def _series(ok_rows: Sequence[_Row]) -> _Series:
    detailed = len({(r["micro_batch_size"], r["precision"]) for r in ok_rows}) > 1
    names = sorted({_Series(detailed, {}).label(r) for r in ok_rows})
    return _Series(detailed, {name: f"C{i % 10}" for i, name in enumerate(names)})


def _plain(text: str) -> str:
    return text.replace("$", r"\$")  # matplotlib reads $…$ as math


def _draw_lines(ax: Any, rows: Sequence[_Row], value: str, series: _Series) -> None:
    for name, points in sorted(group_rows(rows, series.label).items()):
        points = sorted((r for r in points if r[value] is not None), key=lambda r: r["world_size"])
        xs, ys = [r["world_size"] for r in points], [r[value] for r in points]
        ax.plot(xs, ys, marker="o", label=name, color=series.colors[name])
    ax.set_xticks(sorted({r["world_size"] for r in rows}))
    ax.set_xlabel("ranks (world size)")


def _draw_throughput(ax: Any, rows: Sequence[_Row], series: _Series) -> None:
    _draw_lines(ax, rows, "tokens_per_s", series)
    ax.set_ylabel("throughput (tokens/s, all ranks)")
    ax.set_ylim(bottom=0)
    ax.legend()


def _draw_efficiency(ax: Any, rows: Sequence[_Row], series: _Series) -> None:
    _draw_lines(ax, rows, "scaling_efficiency", series)
    ax.axhline(1.0, color="grey", linestyle="--", label="linear scaling (1.0)")
    ax.set_ylabel("scaling efficiency (1.0 = linear)")
    ax.set_ylim(
        0, max([1.0, *(r["scaling_efficiency"] or 0 for r in rows)]) * 1.15
    )  # room for the line at 1.0
    ax.legend()


def _draw_memory(ax: Any, rows: Sequence[_Row], series: _Series) -> None:
    sizes = sorted({r["world_size"] for r in rows})
    groups = sorted(group_rows(rows, series.label).items())
    width = 0.8 / len(groups)
    for i, (name, bars) in enumerate(groups):
        gib = {r["world_size"]: r["peak_memory_gib"] for r in bars}
        xs = [j + (i - (len(groups) - 1) / 2) * width for j, size in enumerate(sizes) if size in gib]
        ax.bar(xs, [gib[size] for size in sizes if size in gib], width, label=name, color=series.colors[name])
    ax.set_xticks(range(len(sizes)), [str(size) for size in sizes])
    ax.set_xlabel("ranks (world size)")
    ax.set_ylabel("peak memory of the largest rank (GiB)")
    ax.margins(y=0.2)  # room above the bars for the legend
    ax.legend()


def _panel_figure(figure: Any, ok_rows: Sequence[_Row], name: str, draw: Callable[..., None]) -> Any:
    """One subplot per set × model, `draw(ax, rows, series)` fills each."""
    panels = group_rows(ok_rows, lambda r: (r["set"], r["model"]))
    ncols = min(max(len(panels), 1), 2)
    nrows = math.ceil(max(len(panels), 1) / ncols)
    fig = figure(figsize=(6.4 * ncols, 4.4 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    fig.suptitle(PLOTS[name])
    series = _series(ok_rows)
    for ax, ((label, model), rows) in zip(axes, panels.items(), strict=False):
        ax.set_title(_plain(f"{label} · {model}"))
        draw(ax, rows, series)
    for ax in axes[len(panels) :]:
        ax.set_axis_off()
    if not panels:
        axes[0].text(0.5, 0.5, "no successful cells", ha="center", va="center", transform=axes[0].transAxes)
    return fig


def _step_time_figure(figure: Any, ok_rows: Sequence[_Row], many_sets: bool) -> Any:
    fig = figure(figsize=(8.0, 1.6 + 0.35 * max(len(ok_rows), 1)), layout="constrained")
    ax = fig.subplots()
    ax.set_title(PLOTS["step_time_distribution.png"])
    if not ok_rows:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no successful cells", ha="center", va="center", transform=ax.transAxes)
        return fig
    p50 = [r["step_time_p50_s"] for r in ok_rows]
    above = [max(r["step_time_p95_s"] - r["step_time_p50_s"], 0.0) for r in ok_rows]
    ax.barh(range(len(ok_rows)), p50, xerr=[[0.0] * len(ok_rows), above], capsize=3, color="C0")
    names = [_plain(f"{r['set']} · {r['id']}" if many_sets else r["id"]) for r in ok_rows]
    ax.set_yticks(range(len(ok_rows)), names)
    ax.invert_yaxis()  # first cell on top, as in the tables
    ax.set_xlabel("step time (s)")
    return fig


def write_plots(rows: Sequence[_Row], out_dir: Path, many_sets: bool) -> list[Path]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    def figure(**kwargs: Any) -> Figure:
        fig = Figure(**kwargs)
        FigureCanvasAgg(fig)
        return fig

    ok = [r for r in rows if r["status"] == "ok"]  # failed cells are listed in the reports, not plotted
    panels = {
        "throughput_vs_world_size.png": _draw_throughput,
        "scaling_efficiency.png": _draw_efficiency,
        "peak_memory.png": _draw_memory,
    }
    paths = []
    for name in PLOTS:
        if name in panels:
            fig = _panel_figure(figure, ok, name, panels[name])
        else:
            fig = _step_time_figure(figure, ok, many_sets)
        fig.savefig(out_dir / name, dpi=110)
        paths.append(out_dir / name)
    return paths
