"""A cost comparison as a terminal table, Markdown, self-contained HTML, a PNG chart and a PDF.

Unknown values print as "unknown" (and are left out of the chart, with the reason on the chart), never as 0.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.cost.comparison import ComparisonData, PlatformEstimate
from gaudi3_scale.document import Image, Section, Table, to_html, to_markdown

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "REPORT_SUFFIXES",
    "plot_tco_breakdown",
    "print_table",
    "table_rows",
    "write_outputs",
    "write_report",
]

REPORT_SUFFIXES = (".md", ".html", ".pdf")
UNKNOWN = "unknown"
_HEADERS = ["platform", "fits on", "nodes × acc", "GiB/acc", "MFU", "step s", "days", "acc-hours", "on-demand",
            "spot", "cap. block", "MWh", "energy $", "$/1M tok", "tok/$", "note"]  # fmt: skip


def usd(value: float | None) -> str:
    if value is None:
        return UNKNOWN
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"${value / scale:,.2f}{suffix}"
    return f"${value:,.2f}"


def count(value: float) -> str:
    """1e12 → "1T", 3e11 → "300B" (the way training budgets are spoken of)."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= scale:
            return f"{value / scale:,.4g}{suffix}"
    return f"{value:,.4g}"


def _num(value: float | None, spec: str) -> str:
    return UNKNOWN if value is None else format(value, spec)


def _row(r: PlatformEstimate) -> list[str]:
    spot = (
        UNKNOWN
        if r.spot_usd_low is None or r.spot_usd_high is None
        else f"{usd(r.spot_usd_low)}–{usd(r.spot_usd_high)}"
    )
    fits_on = "nowhere" if r.min_accelerators is None else f"{r.min_accelerators:,}"
    uses = "—" if r.nodes is None else f"{r.nodes:,} × {r.per_node}"
    return [
        r.platform,
        fits_on,
        uses,
        _num(r.memory_per_device_gib, ",.1f"),
        _num(r.mfu, ".0%"),
        _num(r.step_time_s, ".4g"),
        _num(r.train_hours / 24 if r.train_hours is not None else None, ",.1f"),
        _num(r.accelerator_hours, ",.0f"),
        usd(r.on_demand_usd),
        spot,
        usd(r.capacity_block_usd),
        _num(r.energy_kwh / 1000 if r.energy_kwh is not None else None, ",.1f"),
        usd(r.energy_usd),
        _num(r.usd_per_million_tokens, ",.4f"),
        _num(r.tokens_per_usd, ",.0f"),
        r.note,
    ]


def table_rows(comparison: ComparisonData) -> list[list[str]]:
    return [_row(r) for r in comparison.rows]


def _title(c: ComparisonData) -> str:
    return f"Training cost: {c.model} on {count(c.tokens)} tokens"


def _summary_lines(c: ComparisonData) -> list[str]:
    return [
        f"model {c.model}: {c.parameters:,} parameters, context {c.context_length:,}, "
        f"{c.flops_per_token:.4g} training FLOPs per token",
        f"tokens {count(c.tokens)} ({c.tokens:.4g}); training FLOPs {c.training_flops:.4g}",
    ]


def print_table(comparison: ComparisonData, console: Console) -> None:
    from rich.table import Table as RichTable

    rows = table_rows(comparison)
    # Two tables, so each fits a terminal: fit and time, then money. Notes go below: they are sentences.
    for title, columns in ((_title(comparison) + ": fit and time", (0, 1, 2, 3, 4, 5, 6, 7, 11)),
                           ("cost (USD)", (0, 8, 9, 10, 12, 13, 14))):  # fmt: skip
        table = RichTable(title=title, title_justify="left")
        for i in columns:
            table.add_column(_HEADERS[i], no_wrap=True, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*(row[i] for i in columns))
        console.print(table)
    for r in comparison.rows:
        what = f"{r.platform} = {r.accelerator}" if r.platform != r.accelerator else r.platform
        console.print(f"  {what}: {r.note or 'ok'}", highlight=False, soft_wrap=True)
        if r.step_time_source:
            console.print(f"    step time: {r.step_time_source}", highlight=False, soft_wrap=True)
    for line in _summary_lines(comparison) + comparison.assumptions.lines():
        console.print(f"  {line}", highlight=False, soft_wrap=True)


def _sources(c: ComparisonData) -> list[str]:
    lines = []
    for r in c.rows:
        lines.append(f"{r.accelerator}: peak {r.peak_tflops:,.1f} TFLOP/s — {r.peak_source}")
        lines.append(
            f"{r.accelerator}: price — {r.instance}: {r.price_source}"
            if r.instance
            else f"{r.accelerator}: price — none in the catalog"
        )
        lines.append(f"{r.accelerator}: MFU {_num(r.mfu, '.0%')} — {r.mfu_source}")
        if r.step_time_source:
            lines.append(f"{r.accelerator}: step time {_num(r.step_time_s, '.4g')} s — {r.step_time_source}")
    return lines


def _sections(c: ComparisonData, chart: Path | None) -> list[Section]:
    sections: list[Section] = [
        ("Summary", [_summary_lines(c)]),
        ("Per platform", [Table(_HEADERS, table_rows(c))]),
        ("Assumptions", [c.assumptions.lines()]),
        ("Sources", [_sources(c)]),
    ]
    if chart is not None:
        sections.insert(2, ("Chart", [Image(chart, "cost per platform: on-demand, spot range, energy")]))
    return sections


def plot_tco_breakdown(comparison: ComparisonData, path: str | Path | None = None) -> Any:
    """Two panels: $ per platform (on-demand, spot low–high, capacity block, energy) and training days."""
    from matplotlib.figure import Figure

    rows = comparison.rows
    names = [r.platform for r in rows]
    figure = Figure(figsize=(max(7.0, 1.6 * len(rows) + 3), 7.5), layout="constrained")
    cost_ax, time_ax = figure.subplots(2, 1, height_ratios=[3, 2])
    series = [
        ("on-demand", [r.on_demand_usd for r in rows]),
        ("spot (high end)", [r.spot_usd_high for r in rows]),
        ("capacity block", [r.capacity_block_usd for r in rows]),
        ("energy", [r.energy_usd for r in rows]),
    ]
    series = [(label, values) for label, values in series if any(v is not None for v in values)]
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(rows))]
        heights = [v / 1e6 if v is not None else 0.0 for v in values]
        bars = cost_ax.bar(xs, heights, width, label=label)
        if label.startswith("spot"):
            lows = [r.spot_usd_low for r in rows]
            for bar, low, value in zip(bars, lows, values, strict=True):
                if low is not None and value is not None:
                    cost_ax.plot([bar.get_x(), bar.get_x() + width], [low / 1e6] * 2, color="black", lw=1)
    for x, r in enumerate(rows):
        if r.on_demand_usd is None:
            cost_ax.text(x, 0, "price\nunknown" if r.fits else "does not\nfit", ha="center", va="bottom",
                         fontsize=8, color="#666")  # fmt: skip
    cost_ax.set_xticks(range(len(rows)), names)
    cost_ax.set_ylabel("USD (millions)")
    cost_ax.set_title(_title(comparison).replace("$", r"\$"))
    if series:
        cost_ax.legend(fontsize=8)
    cost_ax.grid(axis="y", alpha=0.3)
    days = [r.train_hours / 24 if r.train_hours is not None else 0.0 for r in rows]
    time_ax.bar(range(len(rows)), days, color="#888")
    for x, r in enumerate(rows):
        label = f"{r.nodes} × {r.per_node}" if r.train_hours is not None else "—"
        time_ax.text(x, days[x], label, ha="center", va="bottom", fontsize=8)
    time_ax.set_xticks(range(len(rows)), names)
    time_ax.set_ylabel("training days (label: nodes × accelerators)")
    time_ax.grid(axis="y", alpha=0.3)
    if path is not None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(figure)
        figure.savefig(str(path), dpi=110)
    return figure


def _write_pdf(c: ComparisonData, path: Path) -> None:
    """Page 1: the chart; page 2: the table and the assumptions, as text."""
    from matplotlib.backends.backend_pdf import FigureCanvasPdf, PdfPages
    from matplotlib.figure import Figure

    with PdfPages(str(path)) as pdf:
        chart = plot_tco_breakdown(c)
        FigureCanvasPdf(chart)
        pdf.savefig(chart)
        page = Figure(figsize=(16.5, 11.7))  # A3 landscape: 15 columns
        FigureCanvasPdf(page)
        ax = page.add_axes((0.02, 0.35, 0.96, 0.6))
        ax.axis("off")
        table = ax.table(
            cellText=[row[:-1] for row in table_rows(c)], colLabels=_HEADERS[:-1], loc="upper center"
        )
        table.auto_set_font_size(False)
        table.set_fontsize(7)
        notes = [f"{r.platform}: {r.note}" for r in c.rows if r.note]
        text = "\n".join(_summary_lines(c) + c.assumptions.lines() + notes).replace("$", r"\$")
        page.text(0.02, 0.3, text, va="top", fontsize=7, wrap=True)
        pdf.savefig(page)


def write_report(comparison: ComparisonData, path: Path) -> Path:
    """The report in the format its suffix names (.md, .html or .pdf); a chart PNG goes beside .md files."""
    suffix = path.suffix.lower()
    if suffix not in REPORT_SUFFIXES:
        raise UserInputError(
            f"{path}: report format must be one of {', '.join(REPORT_SUFFIXES)}, got {suffix!r}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".pdf":
        _write_pdf(comparison, path)
    elif suffix == ".md":
        chart = path.with_suffix(".png")
        plot_tco_breakdown(comparison, chart)
        path.write_text(to_markdown(_title(comparison), _sections(comparison, chart)), encoding="utf-8")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            chart = Path(tmp) / "cost.png"
            plot_tco_breakdown(comparison, chart)
            path.write_text(to_html(_title(comparison), _sections(comparison, chart)), encoding="utf-8")
    return path


def write_outputs(comparison: ComparisonData, out_dir: Path) -> list[Path]:
    """cost.json, cost.md + cost.png, cost.html and cost.pdf in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / "cost.json"
    data.write_text(json.dumps(comparison.to_dict(), indent=2) + "\n", encoding="utf-8")
    written = [data]
    for suffix in REPORT_SUFFIXES:
        written.append(write_report(comparison, out_dir / f"cost{suffix}"))
    written.insert(2, out_dir / "cost.png")
    return written
