"""`gaudi3 benchmark report`: results.csv, plots, report.md and report.html written from result files on disk."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import pytest

from gaudi3_scale.bench.report import PRICE_NOTE, ReportFiles, load_results, write_report
from gaudi3_scale.bench.result import cell_section
from gaudi3_scale.bench.schema import validate_result
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.distributed.plan import BatchPlan

GIB = 2**30
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = {
    "throughput_vs_world_size.png",
    "peak_memory.png",
    "step_time_distribution.png",
    "scaling_efficiency.png",
}
OOM_REASON = "out of memory on rank 3"
SCRIPT_REASON = "<script>alert('x')</script> & exit 1"
CPU = "Test CPU <9000> & Co."  # shown in the tables: escaped there too


def make_result(
    strategy: str,
    world_size: int,
    tokens_per_s: float | None,
    *,
    status: str = "ok",
    reason: str = "",
    device: str | None = None,
    scaling_efficiency: float | None = None,
    accumulation: int = 1,
) -> dict[str, Any]:
    """A valid version-1 result; tokens_per_s None makes a cell that ended with `status` and null metrics."""
    batch = BatchPlan.from_micro_batch(
        4, accumulation=accumulation, data_parallel_size=world_size, context_length=64
    )
    cell = cell_section(cell_id=f"tiny.{strategy}.w{world_size}.mb4.32-true", matrix="t", model="tiny",
                        strategy=strategy, world_size=world_size, nnodes=1, batch=batch, precision="32-true",
                        data="synthetic")  # fmt: skip
    metrics = None
    if tokens_per_s is not None:
        step_s = 4 * world_size * 64 / tokens_per_s
        per_rank = [GIB + 12_345 * (rank + 1) + 1000 * len(strategy) for rank in range(world_size)]
        metrics = {"tokens_per_s": tokens_per_s, "samples_per_s": tokens_per_s / 64,
                   "step_time_s": {"mean": step_s, "p50": step_s * 0.97, "p95": step_s * 1.25, "n": 8},
                   "peak_memory_bytes_per_rank": per_rank, "peak_memory_bytes": max(per_rank), "h2d_gbps": None,
                   "mean_loss": 4.25, "mfu": 0.0123,
                   "scaling_efficiency": 1.0 if world_size == 1 else scaling_efficiency}  # fmt: skip
    cuda = None if device is None else {"device": device, "count": world_size, "runtime": "12.8"}
    env = {"cpu": CPU, "cpu_count": 2, "packages": {"torch": "2.13.0"}, "git_commit": "abc123",
           "cuda": cuda, "date": "2026-01-02T03:04:05+00:00"}  # fmt: skip
    result = {"schema": "gaudi3-scale/benchmark-result", "schema_version": 1, "cell": cell, "status": status,
              "reason": reason, "metrics": metrics, "steps": {"warmup": 2, "measured": 8}, "environment": env,
              "created": "2026-01-02T03:04:05+00:00"}  # fmt: skip
    return validate_result(result, "make_result")


def write_set(directory: Path, results: list[dict[str, Any]]) -> Path:
    for result in results:
        path = directory / "cells" / result["cell"]["id"] / "result.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
    return directory


def cpu_set(directory: Path) -> Path:
    results = [
        make_result("ddp", 1, 1000.5),
        make_result("ddp", 2, 1800.25, scaling_efficiency=1800.25 / 2001.0),
        make_result("fsdp", 1, 950.125),
        make_result("fsdp", 2, 1700.75, scaling_efficiency=1700.75 / 1900.25),
        make_result("ddp", 4, None, status="oom", reason=OOM_REASON),
        make_result("fsdp", 4, None, status="failed", reason=SCRIPT_REASON),
    ]
    write_set(directory, results)
    # The rank-0 copy the runner leaves in run/: it lacks scaling efficiency, so the runner's result.json wins.
    copy = make_result("ddp", 2, 1800.25)
    copy["created"] = (
        "2026-01-02T03:04:06+00:00"  # even a later copy: only the runner's has scaling efficiency
    )
    (directory / "cells" / copy["cell"]["id"] / "run").mkdir()
    (directory / "cells" / copy["cell"]["id"] / "run" / "benchmark_result.json").write_text(json.dumps(copy))
    # JSON of other kinds is ignored, even when it is not valid JSON.
    (directory / "cells" / copy["cell"]["id"] / "run" / "summary.json").write_text(
        '{"schema": "other", "x": 1}'
    )
    (directory / "notes.json").write_text("not json at all")
    return directory


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def one_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ReportFiles]:
    directory = cpu_set(tmp_path_factory.mktemp("sets") / "laptop")
    return directory, write_report([directory], tmp_path_factory.mktemp("report"))


def test_csv_rows_agree_with_the_result_files(one_set: tuple[Path, ReportFiles]) -> None:
    directory, files = one_set
    rows = {row["id"]: row for row in read_csv(files.csv)}
    results = {r.result["cell"]["id"]: r.result for r in load_results([directory])}
    assert (
        rows.keys() == results.keys() and len(rows) == 6
    )  # one row per cell: the run/ copy is not a second one
    for cell_id, result in results.items():
        row, metrics = rows[cell_id], result["metrics"]
        assert row["set"] == "laptop" and row["hardware"] == CPU
        assert {name: row[name] for name in result["cell"]} == {k: str(v) for k, v in result["cell"].items()}
        assert (row["status"], row["reason"]) == (result["status"], result["reason"])
        assert (row["git_commit"], row["date"], row["cost_usd_per_million_tokens"]) == (
            "abc123",
            result["created"],
            "",
        )
        if metrics is None:
            assert (
                row["tokens_per_s"] == row["peak_memory_bytes"] == row["step_time_p95_s"] == row["mfu"] == ""
            )
            continue
        assert float(row["tokens_per_s"]) == metrics["tokens_per_s"]
        assert float(row["samples_per_s"]) == metrics["samples_per_s"]
        step = metrics["step_time_s"]
        got = [float(row[f"step_time_{k}_s"]) for k in ("mean", "p50", "p95")]
        assert got == [step["mean"], step["p50"], step["p95"]]
        assert int(row["peak_memory_bytes"]) == max(
            metrics["peak_memory_bytes_per_rank"]
        )  # an integer, no ".0"
        assert float(row["peak_memory_gib"]) == metrics["peak_memory_bytes"] / GIB
        assert row["h2d_gbps"] == "" and float(row["mean_loss"]) == 4.25 and float(row["mfu"]) == 0.0123
        assert float(row["scaling_efficiency"]) == metrics["scaling_efficiency"]
    assert float(rows["tiny.ddp.w2.mb4.32-true"]["scaling_efficiency"]) == pytest.approx(1800.25 / 2001.0)


def test_every_plot_is_a_readable_png(one_set: tuple[Path, ReportFiles]) -> None:
    from matplotlib.image import imread

    _, files = one_set
    assert {p.name for p in files.plots} == PLOTS
    for path in files.plots:
        assert path.read_bytes()[:8] == PNG_SIGNATURE, path
        height, width, channels = imread(path).shape
        assert height > 200 and width > 300 and channels in (3, 4), path


def test_reports_show_the_csv_values(one_set: tuple[Path, ReportFiles]) -> None:
    _, files = one_set
    markdown, page = files.markdown.read_text(encoding="utf-8"), files.html.read_text(encoding="utf-8")
    rows = read_csv(files.csv)
    for row in (r for r in rows if r["status"] == "ok"):
        shown = [f"{float(row['tokens_per_s']):,.1f}", f"{float(row['samples_per_s']):,.2f}",
                 f"{float(row['step_time_p50_s']):.4f}", f"{float(row['step_time_p95_s']):.4f}",
                 f"{float(row['peak_memory_gib']):.2f}"]  # fmt: skip
        for text in shown:
            assert text in markdown and text in page, (row["id"], text)
    assert "1,800.2" in markdown  # 1800.25 with one decimal, thousands separated
    assert "1.23%" in markdown and "0.90" in markdown  # MFU 0.0123; scaling efficiency 1800.25 / 2001
    for report in (markdown, page):
        assert f"tiny.ddp.w4.mb4.32-true — oom: {OOM_REASON}" in report
    assert all(f"]({name})" in markdown for name in PLOTS)  # Markdown links the PNGs beside it


def test_html_is_self_contained_and_escaped(one_set: tuple[Path, ReportFiles]) -> None:
    _, files = one_set
    page = files.html.read_text(encoding="utf-8")
    assert page.count('src="data:image/png;base64,') == len(PLOTS)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.IGNORECASE)
    assert "<script" not in page.lower() and "<link" not in page.lower()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; exit 1" in page
    assert "<td>Test CPU &lt;9000&gt; &amp; Co.</td>" in page and "<9000>" not in page
    markdown = files.markdown.read_text(encoding="utf-8")
    assert "<script" not in markdown and "&lt;script&gt;" in markdown and "<9000>" not in markdown


def test_two_sets_compare_throughput_and_cost(tmp_path: Path) -> None:
    laptop = cpu_set(tmp_path / "laptop")
    gpu = write_set(tmp_path / "gpu", [
        make_result("ddp", 2, 3 * 1800.25, device="NVIDIA H100 80GB HBM3"),
        make_result("fsdp", 1, 2 * 950.125, device="NVIDIA H100 80GB HBM3"),
        make_result("fsdp", 8, 9000.0, device="NVIDIA H100 80GB HBM3"),  # in one set only: not compared
    ])  # fmt: skip
    prices = {"cpu": 0.5, "h100": 4.0}
    files = write_report([laptop, gpu], tmp_path / "out", labels=["cpu", "h100"], prices_usd_per_hour=prices)

    rows = {(r["set"], r["id"]): r for r in read_csv(files.csv)}
    gpu_ddp = rows[("h100", "tiny.ddp.w2.mb4.32-true")]
    assert gpu_ddp["hardware"] == "NVIDIA H100 80GB HBM3"
    expected_cost = 4.0 / 3600 / (3 * 1800.25) * 1e6
    assert float(gpu_ddp["cost_usd_per_million_tokens"]) == pytest.approx(expected_cost, rel=1e-12)
    cpu_ddp = rows[("cpu", "tiny.ddp.w2.mb4.32-true")]
    assert float(cpu_ddp["cost_usd_per_million_tokens"]) == pytest.approx(0.5 / 3600 / 1800.25 * 1e6)
    assert rows[("cpu", "tiny.ddp.w4.mb4.32-true")]["cost_usd_per_million_tokens"] == ""  # failed: no cost

    markdown = files.markdown.read_text(encoding="utf-8")
    assert "## Comparison across sets" in markdown and PRICE_NOTE in markdown
    assert PRICE_NOTE in files.html.read_text(encoding="utf-8")
    line = next(x for x in markdown.splitlines() if x.startswith("| tiny | ddp | 2 | 4 | 32-true |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    # tokens/s cpu, cost cpu, tokens/s h100, h100 ÷ cpu, cost h100
    cpu_cost = f"{float(cpu_ddp['cost_usd_per_million_tokens']):,.4f}"
    assert cells[5:] == ["1,800.2", cpu_cost, "5,400.8", "3.00", f"{expected_cost:,.4f}"]
    fsdp = next(x for x in markdown.splitlines() if x.startswith("| tiny | fsdp | 1 | 4 | 32-true |"))
    assert "| 2.00 |" in fsdp
    assert not any(x.startswith("| tiny | fsdp | 8 |") for x in markdown.splitlines())


def test_cells_of_two_sets_that_ran_different_work_are_not_compared(tmp_path: Path) -> None:
    """The same id (model, strategy, ranks, micro-batch, precision) with 4 micro-batches a step instead of 1 is other
    work: no ratio between them; the tables show the accumulation, the one field in which the rows differ."""
    acc1 = write_set(tmp_path / "acc1", [make_result("ddp", 1, 100.0), make_result("ddp", 2, 180.0)])
    acc4 = write_set(
        tmp_path / "acc4", [make_result("ddp", 1, 300.0, accumulation=4), make_result("ddp", 2, 190.0)]
    )
    files = write_report([acc1, acc4], tmp_path / "out")
    markdown = files.markdown.read_text(encoding="utf-8")
    comparison = markdown.split("## Comparison across sets")[1].split("## Plots")[0]
    (compared,) = [line for line in comparison.splitlines() if line.startswith("| tiny |")]
    assert compared.startswith(
        "| tiny | ddp | 2 | 4 | 32-true | 180.0 | 190.0 | 1.06 |"
    )  # same work: compared
    results = markdown.split("## Results")[1].split("## Failed")[0]
    assert (
        "| set | strategy | ranks | model | micro-batch | precision | global batch | accumulation | tokens/s |"
        in results
    )
    assert "| acc4 | ddp | 1 | tiny | 4 | 32-true | 16 | 4 | 300.0 |" in results
    # Only one set ran at accumulation 4: nothing to compare.
    files = write_report(
        [acc4, write_set(tmp_path / "acc1-again", [make_result("ddp", 1, 100.0)])], tmp_path / "o2"
    )
    assert "No configuration ran in more than one set." in files.markdown.read_text(encoding="utf-8")


def test_price_for_an_unknown_set_names_it_and_the_sets(tmp_path: Path) -> None:
    laptop = write_set(tmp_path / "laptop", [make_result("ddp", 1, 10.0)])
    with pytest.raises(UserInputError, match=r"'h100'.*laptop"):
        write_report([laptop], tmp_path / "out", prices_usd_per_hour={"h100": 4.0})
    assert not (tmp_path / "out").exists()


def test_load_results_labels_by_directory_name(tmp_path: Path) -> None:
    a = write_set(tmp_path / "a", [make_result("ddp", 1, 10.0), make_result("ddp", 2, 18.0)])
    b = write_set(tmp_path / "b", [make_result("ddp", 1, 30.0)])
    loaded = load_results([a, b])
    assert sorted((r.label, r.result["metrics"]["tokens_per_s"]) for r in loaded) == [
        ("a", 10.0),
        ("a", 18.0),
        ("b", 30.0),
    ]
    same_name = write_set(tmp_path / "again" / "a", [make_result("ddp", 1, 10.0)])
    with pytest.raises(UserInputError, match="both labelled 'a'"):
        load_results([a, same_name])


def _missing_tokens(path: Path) -> None:
    result = make_result("ddp", 1, 10.0)
    del result["metrics"]["tokens_per_s"]
    path.write_text(json.dumps(result))


def _cut_short(path: Path) -> None:
    path.write_text(json.dumps(make_result("ddp", 1, 10.0))[:-40])


@pytest.mark.parametrize(
    ("damage", "message"),
    [(_missing_tokens, "metrics.tokens_per_s is missing"), (_cut_short, "not valid JSON")],
)
def test_a_damaged_result_names_its_file(tmp_path: Path, damage: Any, message: str) -> None:
    directory = write_set(tmp_path / "set", [make_result("fsdp", 1, 10.0)])
    bad = directory / "cells" / "broken" / "result.json"
    bad.parent.mkdir(parents=True)
    damage(bad)
    with pytest.raises(UserInputError) as info:
        write_report([directory], tmp_path / "out")
    assert str(bad) in str(info.value) and message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["cells/tiny.ddp.w1.mb4.32-true/result.json",
                                  "cells/tiny.ddp.w1.mb4.32-true/run/benchmark_result.json"])  # fmt: skip
def test_a_result_cut_before_its_schema_string_is_named_not_dropped(tmp_path: Path, name: str) -> None:
    """The runner writes sorted keys: "schema" is near the end, so a cut-short copy no longer names the schema. It
    is still a result by its name: an error naming it and what to do, never a report without the cell."""
    directory = write_set(tmp_path / "set", [make_result("fsdp", 1, 10.0)])
    bad = directory / name
    bad.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(make_result("ddp", 1, 10.0), indent=2, sort_keys=True)
    bad.write_text(text[: text.index('"schema"')])
    with pytest.raises(UserInputError) as info:
        write_report([directory], tmp_path / "out")
    assert str(info.value).startswith(f"{bad}: not valid JSON at line ")
    assert str(info.value).endswith("a damaged benchmark result: run its cell again, or delete the file")
    assert not (tmp_path / "out").exists()
    # Other JSON that is cut short, or names no schema, is still not a result (configs, manifests, tokenizers).
    bad.unlink()
    (directory / "cells" / "result.json").write_text("{")  # not cells/<id>/result.json
    (directory / "cells" / "tiny.fsdp.w1.mb4.32-true" / "summary.json").write_text('{"step": ')
    assert [item.result["cell"]["id"] for item in load_results([directory])] == ["tiny.fsdp.w1.mb4.32-true"]


def test_a_directory_without_results_is_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    (empty / "run").mkdir(parents=True)
    (empty / "run" / "summary.json").write_text('{"schema": "something-else"}')
    with pytest.raises(UserInputError, match=re.escape(f"{empty}: no benchmark results")):
        write_report([empty], tmp_path / "out")
    with pytest.raises(UserInputError, match=re.escape(f"{tmp_path / 'absent'}: not a directory")):
        load_results([tmp_path / "absent"])


def test_a_set_where_every_cell_failed_still_reports(tmp_path: Path) -> None:
    timed_out = make_result("ddp", 2, None, status="timeout", reason="no step within 600 s")
    files = write_report([write_set(tmp_path / "bad", [timed_out])], tmp_path / "out")
    (row,) = read_csv(files.csv)
    assert (row["status"], row["tokens_per_s"], row["peak_memory_bytes"]) == ("timeout", "", "")
    assert all(path.read_bytes()[:8] == PNG_SIGNATURE for path in files.plots)
    assert "tiny.ddp.w2.mb4.32-true — timeout: no step within 600 s" in files.markdown.read_text(
        encoding="utf-8"
    )
