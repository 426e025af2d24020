"""How the benchmark scripts keep their results files (benchmarks/results/*.json): written atomically, merged
without losing a good entry, refused when unreadable; and the machine info says whether the tree was dirty."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest

from gaudi3_scale.bench.result import keep_good_entry, load_stored_results, write_json_atomic
from gaudi3_scale.monitor.environment import environment_info

ROOT = Path(__file__).resolve().parents[2]


def test_a_results_file_is_replaced_whole_never_rewritten_in_place(tmp_path: Path) -> None:
    """A reader (or a kill mid-write) sees the old file or the new one: the new one is a new file renamed in."""
    out = tmp_path / "r.json"
    out.write_text('{"cells": {"a": 1}}\n')
    with out.open() as before:
        write_json_atomic(out, {"cells": {"b": 2}})
        assert before.read() == '{"cells": {"a": 1}}\n'  # in place, the old handle would read the new text
    assert json.loads(out.read_text()) == {"cells": {"b": 2}}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_an_unreadable_results_file_is_refused(tmp_path: Path) -> None:
    assert load_stored_results(tmp_path / "none.json", {"cells": {}}) == {"cells": {}}
    truncated = tmp_path / "t.json"
    truncated.write_text('{"cells": {"a": {"pla')
    with pytest.raises(ValueError, match=f"cannot merge into {truncated}: not readable JSON"):
        load_stored_results(truncated, {})
    truncated.write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        load_stored_results(truncated, {})


def test_a_failed_entry_never_replaces_a_good_one() -> None:
    def ok(entry: dict) -> bool:
        return entry["status"] == "ok"

    table = {"a": {"status": "ok", "ms": 1.0}}
    assert not keep_good_entry(table, "a", {"status": "timeout"}, ok)
    assert table["a"] == {"status": "ok", "ms": 1.0, "failed_attempts": [{"status": "timeout"}]}
    assert keep_good_entry(table, "a", {"status": "ok", "ms": 2.0}, ok) and table["a"] == {
        "status": "ok",
        "ms": 2.0,
    }
    assert keep_good_entry(table, "b", {"status": "failed"}, ok) and table["b"] == {"status": "failed"}


def _writes_results_in_place(path: Path) -> list[int]:
    """Lines where a script calls `out.write_text(...)` / `args.out.write_text(...)`: a results file rewritten in
    place (a kill mid-write truncates it)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "write_text"
            and ast.unparse(node.func.value) in ("out", "args.out")
        ):
            lines.append(node.lineno)
    return lines


def test_no_benchmark_script_rewrites_its_results_in_place() -> None:
    found = {
        p.name: lines
        for p in sorted((ROOT / "benchmarks").glob("*.py"))
        if (lines := _writes_results_in_place(p))
    }
    assert found == {}


def test_the_machine_info_says_whether_the_tree_had_uncommitted_changes() -> None:
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                            text=True, cwd=ROOT)  # fmt: skip
    expected = bool(status.stdout.strip()) if status.returncode == 0 else None
    assert environment_info()["git_dirty"] is expected
