"""`gaudi3 benchmark collect LOG…`: recover cell results from logs (e.g. `kubectl logs` of a PyTorchJob's pods).

Reads the marker lines `bench.result.print_result` writes (see there), wherever they sit in a line (log shippers
prefix lines) and whatever other ranks printed between them; reassembles, checks the hash, validates the schema.
`save_collected` writes them into a results directory without ever replacing a result there by an older one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gaudi3_scale.bench.result import BEGIN, CHUNK, END, cell_result_path, write_result
from gaudi3_scale.bench.schema import created_time, load_result, validate_result
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.config.files import check_output_dir, parse_json

__all__ = ["Saved", "collect_from_lines", "collect_logs", "save_collected"]

_BEGIN = re.compile(rf"{BEGIN} (\S+) (\d+) ([0-9a-f]{{64}})\s*$")
_CHUNK = re.compile(rf"{CHUNK} (\S+) (\d+) ([A-Za-z0-9+/=]*)\s*$")
_END = re.compile(rf"{END} (\S+)\s*$")


@dataclass
class _Pending:
    chunks: int
    digest: str
    line: int
    parts: dict[int, str] = field(default_factory=dict)


def collect_from_lines(lines: Iterable[str], source: str) -> list[dict[str, Any]]:
    """Every complete result in `lines`, in order of their END markers; a damaged one is a UserInputError naming
    `source` and the line of its BEGIN marker. A BEGIN without its END (a log cut short) is skipped."""
    pending: dict[str, _Pending] = {}
    found: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if match := _BEGIN.search(line):
            cell_id, chunks, digest = match.group(1), int(match.group(2)), match.group(3)
            pending[cell_id] = _Pending(chunks=chunks, digest=digest, line=number)
        elif match := _CHUNK.search(line):
            cell_id, index, data = match.group(1), int(match.group(2)), match.group(3)
            if cell_id in pending:
                pending[cell_id].parts[index] = data
        elif (match := _END.search(line)) and match.group(1) in pending:
            found.append(_assemble(match.group(1), pending.pop(match.group(1)), source))
    return found


def _assemble(cell_id: str, p: _Pending, source: str) -> dict[str, Any]:
    where = f"{source}:{p.line}"
    missing = [i for i in range(p.chunks) if i not in p.parts]
    if missing:
        raise UserInputError(
            f"{where}: result of cell {cell_id} is missing chunk(s) {', '.join(map(str, missing[:5]))} "
            f"of {p.chunks}"
        )
    try:
        text = base64.b64decode("".join(p.parts[i] for i in range(p.chunks)), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise UserInputError(f"{where}: result of cell {cell_id} is not valid base64 text") from None
    if hashlib.sha256(text.encode()).hexdigest() != p.digest:
        raise UserInputError(f"{where}: result of cell {cell_id} does not match its sha256 (a mangled chunk)")
    obj = parse_json(text, where=f"{where}: result of cell {cell_id}", expect=None)
    return validate_result(obj, where)


def collect_logs(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Results from every log file; a cell reported in several logs (every pod of a job prints nothing but rank 0's
    result, yet logs get re-collected) keeps its latest copy by `created`."""
    by_id: dict[str, dict[str, Any]] = {}
    for path in paths:
        try:
            with path.open(errors="replace") as f:
                results = collect_from_lines(f, str(path))
        except OSError as exc:
            raise UserInputError(f"{path}: cannot read log ({exc.strerror or exc})") from None
        for result in results:
            cell_id = result["cell"]["id"]
            if cell_id not in by_id or created_time(result) >= created_time(by_id[cell_id]):
                by_id[cell_id] = result
    return list(by_id.values())


@dataclass(frozen=True)
class Saved:
    out_dir: Path
    written: list[Path]  # the result files written
    kept: list[str]  # one line per result not written, because the directory holds one as new or newer

    def lines(self) -> list[str]:
        """What the collect commands print: each result kept, then the count written."""
        kept = f" ({len(self.kept)} kept: the directory's copy is as new or newer)" if self.kept else ""
        return [*self.kept, f"{len(self.written)} result(s) → {self.out_dir}/cells/{kept}"]


def save_collected(results: list[dict[str, Any]], out_dir: Path) -> Saved:
    """Write each result to `out_dir/cells/<id>/result.json`, unless the file there holds a result of that cell
    created at the same time or later: the same logs collected again, or an older attempt, never replace it (the
    runner's copy also carries scaling efficiency). Every existing file is read before the first is written: a
    damaged one is a UserInputError naming it, and nothing is written."""
    plan: list[tuple[dict[str, Any], Path]] = []
    kept: list[str] = []
    for result in results:
        path = cell_result_path(out_dir, result["cell"]["id"])
        check_output_dir("--out", path.parent)
        stored = _stored(path)
        if stored is not None and created_time(stored) >= created_time(result):
            kept.append(f"kept {path} (created {stored['created']}), not the older or same result from the "
                        f"logs (created {result['created']})")  # fmt: skip
        else:
            plan.append((result, path))
    for result, path in plan:
        write_result(result, path)
    return Saved(out_dir=out_dir, written=[path for _, path in plan], kept=kept)


def _stored(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    if not path.is_file():
        raise UserInputError(
            f"{path}: not a file; a cell's result goes there (move it, or use another --out)"
        )
    try:
        return load_result(path)
    except UserInputError as exc:
        raise UserInputError(
            f"{exc} (a result already there: delete it, or collect into another --out)"
        ) from None
