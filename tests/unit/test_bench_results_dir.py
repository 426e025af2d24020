"""A benchmark results directory (OUT/matrix.yaml, OUT/cells/<id>/result.json): what `benchmark run`, `benchmark
collect` and `deploy collect` refuse to reuse or replace there, and what a matrix's `base` may not set. Results are
written by hand (no cell trains here)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gaudi3_scale.bench.cell import cell_of_config
from gaudi3_scale.bench.collect import save_collected
from gaudi3_scale.bench.matrix import load_matrix
from gaudi3_scale.bench.result import (
    cell_result_path,
    failed_result,
    print_result,
    result_from_metrics,
    write_result,
)
from gaudi3_scale.bench.runner import check_results_dir
from gaudi3_scale.config.core import save_yaml
from gaudi3_scale.config.errors import UserInputError

Cli = Callable[..., tuple[int, str, str]]

MATRIX_A = """name: matrix-a
models: [shakespeare-char]
strategies: [ddp]
world_sizes: [1]
micro_batch_sizes: [2]
precisions: [32-true]
data: synthetic
warmup_steps: 1
measure_steps: 2
timeout_s: 60
base: {model: {dropout: 0.1}, train: {threads: 1}}
"""
CELL = "shakespeare-char.ddp.w1.mb2.32-true"


def _gaudi3(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def _refused(code: int, out: str, err: str, *needles: str) -> str:
    """The one line on stderr of a refusal: exit 2, nothing on stdout, no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _matrix(tmp_path: Path, text: str = MATRIX_A, name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _ok_result(matrix_text: str, tmp_path: Path, created: str | None = None) -> dict[str, Any]:
    """The ok result the one cell of `matrix_text` prints, made from per-step records as its rank 0 makes it."""
    _, (cell,) = load_matrix(_matrix(tmp_path, matrix_text, "cell-of.yaml"))
    records = [{"step": s, "train_loss": 4.0, "step_time_s": 0.1, "peak_memory_bytes_per_rank": [2**20]}
               for s in (1, 2, 3)]  # fmt: skip
    result = result_from_metrics(cell_of_config(cell.config, precision="32-true"), records, warmup_steps=1,
                                 h2d_gbps=None, environment={"cpu": "test"})  # fmt: skip
    return result if created is None else {**result, "created": created}


def _results_dir(tmp_path: Path, *, with_matrix: bool = True) -> Path:
    """OUT as `benchmark run --matrix MATRIX_A` leaves it (its matrix.yaml optional: a directory of collected
    results has none)."""
    out = tmp_path / "out"
    write_result(_ok_result(MATRIX_A, tmp_path), cell_result_path(out, CELL))
    if with_matrix:
        matrix, _ = load_matrix(_matrix(tmp_path))
        save_yaml(matrix, out / "matrix.yaml")
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def load_json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _log(path: Path, *results: dict[str, Any]) -> Path:
    printed = io.StringIO()
    for result in results:
        print_result(result, printed)
    path.write_text(printed.getvalue())
    return path


# ---- benchmark run: another matrix's results are never reused, its matrix.yaml never replaced -----------------------


def test_a_run_into_another_matrixs_results_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    out = _results_dir(tmp_path)
    before = _files(out)
    other = MATRIX_A.replace("matrix-a", "matrix-b").replace("synthetic", "tinyshakespeare")
    proc = _gaudi3("benchmark", "run", "--matrix", str(_matrix(tmp_path, other, "b.yaml")), "--out", str(out))
    _refused(proc.returncode, proc.stdout, proc.stderr,
             f"{out} holds the results of another matrix (matrix.yaml: name 'matrix-a' there, 'matrix-b' here); "
             "allowed: the same matrix, or another --out")  # fmt: skip
    assert _files(out) == before  # matrix.yaml and the result as they were


@pytest.mark.parametrize(
    ("edit", "differs"),
    [
        (("matrix-a", "matrix-b"), "cell.matrix 'matrix-a' there, 'matrix-b' here"),
        (("data: synthetic", "data: tinyshakespeare"), "cell.data 'synthetic' there, 'tinyshakespeare' here"),
        (("data: synthetic", "data: synthetic\naccumulation: 3"), "cell.global_batch_size 2 there, 6 here"),
        (("measure_steps: 2", "measure_steps: 50"), "steps.measured 2 there, 50 here"),
        (("warmup_steps: 1", "warmup_steps: 0"), "steps.warmup 1 there, 0 here"),
    ],
)
def test_a_result_another_configuration_made_is_not_reused(
    tmp_path: Path, edit: tuple[str, str], differs: str
) -> None:
    """Without a matrix.yaml (results collected into the directory), each result is checked against the cell it
    would stand for; the same matrix reuses it."""
    out = _results_dir(tmp_path, with_matrix=False)
    matrix, cells = load_matrix(_matrix(tmp_path))
    assert list(check_results_dir(matrix, cells, out)) == [CELL]
    matrix, cells = load_matrix(_matrix(tmp_path, MATRIX_A.replace(*edit), "edited.yaml"))
    with pytest.raises(UserInputError) as info:
        check_results_dir(matrix, cells, out)
    assert str(info.value) == (f"{out} holds the results of another matrix (cells/{CELL}/result.json: {differs}); "
                               "allowed: the same matrix, or another --out")  # fmt: skip


def test_the_same_matrix_reuses_its_results(tmp_path: Path) -> None:
    out = _results_dir(tmp_path)
    matrix, cells = load_matrix(_matrix(tmp_path))
    (done,) = check_results_dir(matrix, cells, out).values()
    assert done["status"] == "ok" and done["cell"]["id"] == CELL


# ---- collect: ids that are not plain names, older results -----------------------------------------------------------


@pytest.mark.parametrize("verb", ["benchmark", "deploy"])
def test_collect_refuses_a_cell_id_that_leads_out_of_the_results_directory(
    tmp_path: Path, gaudi3_cli: Cli, verb: str
) -> None:
    victim = tmp_path / "victim" / "abs" / "result.json"
    victim.parent.mkdir(parents=True)
    victim.write_text('{"precious": true}')
    for cell_id in ("../../escaped", str(victim.parent)):
        result = _ok_result(MATRIX_A, tmp_path)
        result["cell"]["id"] = cell_id
        log = _log(tmp_path / "evil.log", result)
        _refused(*gaudi3_cli(verb, "collect", str(log), "--out", str(tmp_path / "res" / "sub")),
                 f"{log}:1: cell.id: must be 1 to 128 letters")  # fmt: skip
    assert victim.read_text() == '{"precious": true}'
    assert not (tmp_path / "res").exists() and not (tmp_path / "escaped").exists()


def test_collect_by_subprocess_writes_nothing_outside_cells(tmp_path: Path) -> None:
    result = _ok_result(MATRIX_A, tmp_path)
    result["cell"]["id"] = "../../escaped"
    log = _log(tmp_path / "evil.log", result)
    proc = _gaudi3("benchmark", "collect", str(log), "--out", str(tmp_path / "res" / "sub"))
    _refused(proc.returncode, proc.stdout, proc.stderr, "cell.id: must be", "'../../escaped'")
    assert sorted(_files(tmp_path)) == ["cell-of.yaml", "evil.log"]


def test_collect_never_replaces_a_result_by_an_older_or_the_same_one(tmp_path: Path) -> None:
    out = _results_dir(tmp_path)  # the runner's result, made now
    path = cell_result_path(out, CELL)
    kept = path.read_bytes()
    cell = load_matrix(_matrix(tmp_path))[1][0]
    old = failed_result(cell_of_config(cell.config, precision="32-true"), "failed", "a crash in 2020",
                        warmup_steps=1, environment={}) | {"created": "2020-01-01T00:00:00+00:00"}  # fmt: skip
    proc = _gaudi3("benchmark", "collect", str(_log(tmp_path / "old.log", old)), "--out", str(out))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines() == [
        f"kept {path} (created {load_json(path)['created']}), not the older or same result from the logs "
        "(created 2020-01-01T00:00:00+00:00)",
        f"0 result(s) → {out}/cells/ (1 kept: the directory's copy is as new or newer)",
    ]
    assert path.read_bytes() == kept
    same = save_collected([load_json(path) | {"metrics": None, "status": "timeout"}], out)  # same `created`
    assert same.written == [] and len(same.kept) == 1 and path.read_bytes() == kept
    newer = _ok_result(MATRIX_A, tmp_path, created="2099-01-01T00:00:00+00:00")
    assert save_collected([newer], out).written == [path] and load_json(path) == newer


def test_collect_into_a_damaged_result_writes_nothing(tmp_path: Path, gaudi3_cli: Cli) -> None:
    out = tmp_path / "out"
    damaged = cell_result_path(out, CELL)
    damaged.parent.mkdir(parents=True)
    damaged.write_text('{"cell": ')
    fresh = _ok_result(MATRIX_A, tmp_path)
    fresh["cell"]["id"] = "another.cell"
    log = _log(tmp_path / "pods.log", fresh, _ok_result(MATRIX_A, tmp_path))
    _refused(*gaudi3_cli("deploy", "collect", str(log), "--out", str(out)), str(damaged),
             "delete it, or collect into another --out")  # fmt: skip
    assert damaged.read_text() == '{"cell": ' and not cell_result_path(out, "another.cell").exists()


# ---- report: a result cut short is named, never dropped -------------------------------------------------------------


def test_report_of_a_cut_short_result_is_one_line_and_writes_nothing(tmp_path: Path, gaudi3_cli: Cli) -> None:
    out = _results_dir(tmp_path)
    path = cell_result_path(out, CELL)
    text = json.dumps(
        load_json(path), indent=2, sort_keys=True
    )  # as the runner's copy reads: "schema" near the end
    path.write_text(text[: text.index('"schema"')])
    _refused(*gaudi3_cli("benchmark", "report", str(out), "--out", str(tmp_path / "report")),
             f"{path}: not valid JSON", "a damaged benchmark result: run its cell again, or delete the file")  # fmt: skip
    assert not (tmp_path / "report").exists()


# ---- --out that is, or is inside, a file ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command", ["benchmark run", "benchmark collect", "benchmark report", "deploy collect"]
)
def test_out_inside_a_file_is_one_line(tmp_path: Path, gaudi3_cli: Cli, command: str) -> None:
    a_file = tmp_path / "afile"
    a_file.write_text("hi")
    inputs = {
        "benchmark run": ["--matrix", str(_matrix(tmp_path))],
        "benchmark collect": [str(_log(tmp_path / "pod.log", _ok_result(MATRIX_A, tmp_path)))],
        "benchmark report": [str(_results_dir(tmp_path))],
        "deploy collect": [str(_log(tmp_path / "pod.log", _ok_result(MATRIX_A, tmp_path)))],
    }
    _refused(*gaudi3_cli(*command.split(), *inputs[command], "--out", str(a_file / "sub")),
             f"--out: '{a_file / 'sub'}' is inside '{a_file}', which is a file")  # fmt: skip
    assert a_file.read_text() == "hi"


# ---- a matrix's base: nothing the matrix sets itself ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "message"),
    [
        ("{data: {source: tinyshakespeare}}", "base.data.source: set by the matrix's `data` (use data: tinyshakespeare)"),
        ("{train: {precision: bf16-mixed}}", "base.train.precision: set by the matrix's `precisions` "
                                             "(use precisions: [bf16-mixed])"),
        ("{parallel: {strategy: fsdp}}", "base.parallel.strategy: set by the matrix's `strategies` (use strategies: [fsdp])"),
        ("{model: {name: gpt2-124m, num_layers: 1}}", "base.model.name: set by the matrix's `models`"),
        ("{train: {global_batch_size: 64}}", "base.train.global_batch_size: set by the matrix: micro-batch × ranks × "
                                             "`accumulation`"),
        ("{train: {max_steps: 5}}", "base.train.max_steps: set by the matrix: `warmup_steps` + `measure_steps`"),
        ("{checkpoint: {enabled: true}}", "base.checkpoint.enabled: set in every benchmark cell"),
        ("{data: tinyshakespeare}", "base.data: set by the matrix's `data` (use data: tinyshakespeare)"),
        ("{name: mine}", "base.name: set in every cell (a cell is named by its id)"),
        # A cell is a short run made to measure, under its label: what would change what it runs is refused too.
        ("{train: {profile_start_step: 1, profile_num_steps: 2}}", "base.train.profile_start_step: a benchmark cell "
                                                                   "is not profiled: the profiler's steps would be "
                                                                   "measured"),
        ("{train: {max_epochs: 1}}", "base.train.max_epochs: set by the matrix: `warmup_steps` + `measure_steps`"),
        ("{train: {global_batch_tokens: 256}}", "base.train.global_batch_tokens: set by the matrix: micro-batch × "
                                                "ranks × `accumulation`"),
        ("{data: {mixture: [{source: tinyshakespeare, weight: 1}]}}", "base.data.mixture: set by the matrix's "
                                                                      "`data`: a cell reads that one source"),
        ("{model: {num_layers: 1}}", "base.model.num_layers: set by the matrix's `models`: a cell runs its preset's "
                                     "shape, under the preset's name"),
        ("{cost: {budget_usd: 0.01}}", "base.cost.budget_usd: set in every benchmark cell, a short run made to "
                                       "measure"),
        ("{monitor: {metrics_port: 9400}}", "base.monitor.metrics_port: set in every benchmark cell"),
    ],
)  # fmt: skip
def test_a_base_field_the_matrix_sets_is_refused(
    tmp_path: Path, gaudi3_cli: Cli, base: str, message: str
) -> None:
    path = _matrix(
        tmp_path, MATRIX_A.replace("base: {model: {dropout: 0.1}, train: {threads: 1}}", f"base: {base}")
    )
    with pytest.raises(UserInputError) as info:
        load_matrix(path)
    assert str(info.value).startswith(f"{path}: {message}")
    _refused(*gaudi3_cli("benchmark", "run", "--matrix", str(path), "--out", str(tmp_path / "o"), "--dry-run"),
             message)  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_a_base_of_other_fields_and_the_shipped_matrices_load(tmp_path: Path) -> None:
    _, (cell,) = load_matrix(_matrix(tmp_path))
    # dropout is the run's, not the preset's shape: honoured; the shape is shakespeare-char's own
    assert (cell.config.model.dropout, cell.config.model.num_layers, cell.config.train.threads) == (0.1, 4, 1)
    assert cell.config.data.source == "synthetic"
    assert [len(load_matrix(name)[1]) for name in ("cpu-small", "tinygpt-117m")] == [4, 12]
