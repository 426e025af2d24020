"""The text inside JSONL and Parquet sources (the formats Hugging Face datasets are distributed in).

A source file ending in ``.jsonl`` / ``.json`` (JSON lines) or ``.parquet`` is a table; its ``data.text_field``
column holds the documents. Each non-null row contributes its text followed by a blank line (``"\\n\\n"``, as
``hf:NAME`` sources are written), so the text of a byte range or a row group does not depend on its neighbours and
pieces can be read independently. Any other file is plain UTF-8 text.

A JSON line may nest at most `MAX_JSONL_DEPTH` levels: Python's json recurses once per level (a RecursionError
near 1,000) and so does pyarrow's reader (a segmentation fault somewhere past 16,000 here, sooner on a thread's
smaller stack). Errors name the file and the line in it.

pyarrow is an optional dependency (the ``parquet`` extra), imported only when such a file is read.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gaudi3_scale.config.errors import UserInputError

__all__ = [
    "JSONL",
    "MAX_JSONL_DEPTH",
    "PARQUET",
    "TEXT",
    "check_jsonl_field",
    "jsonl_texts",
    "parquet_row_group_sizes",
    "parquet_texts",
    "source_format",
]

TEXT, JSONL, PARQUET = "text", "jsonl", "parquet"
_SUFFIXES = {".jsonl": JSONL, ".json": JSONL, ".parquet": PARQUET}
ROW_END = "\n\n"
_BATCH_ROWS = 4096  # Parquet rows decoded at a time: a few MiB of text for typical documents
# Levels of [ and { in one JSON line: far above real records (Hugging Face datasets nest a few levels), well below
# where either parser fails (see the module docstring).
MAX_JSONL_DEPTH = 512
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # brackets inside strings are text
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_ARROW_ROW = re.compile(r"^(?:JSON parse error: )?(.*?)\.? in row ([0-9]+)$")


def source_format(path: Path | str) -> str:
    return _SUFFIXES.get(Path(path).suffix.lower(), TEXT)


def _pyarrow(module: str) -> Any:
    try:
        if module == "json":
            import pyarrow.json as pa_json

            return pa_json
        import pyarrow.parquet as pa_parquet

        return pa_parquet
    except ImportError:
        raise UserInputError(
            "JSONL / Parquet sources need pyarrow: pip install 'gaudi3-scale[parquet]'"
        ) from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _missing_column(path: str, field: str, columns: list[str]) -> UserInputError:
    return UserInputError(
        f"{path}: no column {field!r} (data.text_field); its columns: {', '.join(columns) or 'none'}"
    )


def _row_texts(column: Any, path: str, field: str, row_of: Any) -> Iterator[str]:
    """The non-empty strings of an Arrow column, each with `ROW_END`; `row_of(i)` says where row i is for errors."""
    import pyarrow as pa

    if pa.types.is_null(column.type):
        return
    if pa.types.is_dictionary(column.type):  # what pandas writes a `category` column as: decode to its values
        column = column.cast(column.type.value_type)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        first = next(i for i, value in enumerate(column.to_pylist()) if value is not None)
        raise UserInputError(
            f"{path}: {row_of(first)}: column {field!r} holds {column.type}, not a string; "
            "set data.text_field to a text column"
        )
    for value in column.to_pylist():
        if value:  # a null or empty row holds no text: no row separator either
            yield value + ROW_END


def jsonl_texts(path: str, offset_bytes: int, length_bytes: int, field: str) -> Iterator[str]:
    """Rows of the JSON-lines byte range [offset, offset + length), which starts and ends at line boundaries."""
    pa_json = _pyarrow("json")
    with open(path, "rb") as fh:
        fh.seek(offset_bytes)
        raw = fh.read(length_bytes)
    if not raw.strip():
        return
    _check_nesting(path, raw, offset_bytes)
    # One block for the whole range (a block may not split a record) and no threads: the workers are the
    # parallelism, and pyarrow's pool on top of them would only oversubscribe the cores.
    options = pa_json.ReadOptions(use_threads=False, block_size=len(raw) + 1)

    def line_of_row(i: int) -> int:
        """The file's line number of row i: pyarrow numbers rows from 0 and skips blank lines."""
        lines = [n for n, text in enumerate(raw.split(b"\n")) if text.strip()]
        return _line_before(path, offset_bytes) + lines[i] + 1

    try:
        table = pa_json.read_json(io.BytesIO(raw), read_options=options)
    except Exception as exc:  # ArrowInvalid: bad JSON, a column that changes type
        raise _bad_json_lines(path, _first_line(exc), line_of_row, offset_bytes) from None
    if field not in table.column_names:
        raise _missing_column(path, field, table.column_names)
    column = table.column(field).combine_chunks()
    yield from _row_texts(column, path, field, lambda i: f"line {line_of_row(i)}")


def _bad_json_lines(
    path: str, message: str, line_of_row: Callable[[int], int], offset_bytes: int
) -> UserInputError:
    """pyarrow's "JSON parse error: <what> in row N" as one line naming the line of the file."""
    found = _ARROW_ROW.match(message)
    if found is None:  # no row named: say where the range starts
        where = f"in the lines from line {_line_before(path, offset_bytes) + 1}"
        return UserInputError(f"{path}: not valid JSON lines ({where}): {message}")
    return UserInputError(
        f"{path}: line {line_of_row(int(found.group(2)))}: not valid JSON lines: {found.group(1)}"
    )


def check_jsonl_field(path: str, field: str) -> None:
    """Refuse a JSON-lines file whose first record lacks `field`, before any worker starts (the whole file is
    checked as it is read)."""
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, start=1):
            if line.strip():
                if _too_deep(line):
                    raise _nested_too_deep(path, number)
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    detail = (
                        f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else exc
                    )
                    raise UserInputError(f"{path}: line {number}: not valid JSON lines: {detail}") from None
                if isinstance(record, dict) and field not in record:
                    raise _missing_column(path, field, list(record))
                return


def _too_deep(line: bytes) -> bool:
    """Whether one JSON line nests deeper than `MAX_JSONL_DEPTH` (counting [ and { outside strings)."""
    if line.count(b"[") + line.count(b"{") <= MAX_JSONL_DEPTH:
        return False  # the common case, at the speed of bytes.count
    depth = 0
    for bracket in _JSON_STRING.sub(b"", line).translate(None, delete=_NOT_BRACKETS):
        depth += 1 if bracket in b"[{" else -1
        if depth > MAX_JSONL_DEPTH:
            return True
    return False


def _check_nesting(path: str, raw: bytes, offset_bytes: int) -> None:
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSONL_DEPTH:
        return
    for number, line in enumerate(raw.split(b"\n")):
        if _too_deep(line):
            raise _nested_too_deep(path, _line_before(path, offset_bytes) + number + 1)


def _nested_too_deep(path: str, line: int) -> UserInputError:
    return UserInputError(
        f"{path}: line {line}: JSON nested more than {MAX_JSONL_DEPTH} levels deep; allowed: at most "
        f"{MAX_JSONL_DEPTH}"
    )


def _line_before(path: str, offset_bytes: int) -> int:
    """Newlines before `offset_bytes` (only for error messages: it reads the file up to there)."""
    with open(path, "rb") as fh:
        return fh.read(offset_bytes).count(b"\n")


def parquet_row_group_sizes(path: str, field: str) -> list[int]:
    """Uncompressed bytes of the text column in each row group: how prepare sizes Parquet pieces."""
    pa_parquet = _pyarrow("parquet")
    try:
        meta = pa_parquet.ParquetFile(path).metadata
    except Exception as exc:  # ArrowInvalid: not a Parquet file
        raise UserInputError(f"{path}: not a readable Parquet file: {_first_line(exc)}") from None
    columns = [meta.schema.column(i).path for i in range(meta.num_columns)]
    if field not in columns:
        raise _missing_column(path, field, columns)
    index = columns.index(field)
    return [meta.row_group(g).column(index).total_uncompressed_size for g in range(meta.num_row_groups)]


def parquet_texts(path: str, row_groups: tuple[int, ...], field: str) -> Iterator[str]:
    """Rows of the given row groups of a Parquet file, in order."""
    pa_parquet = _pyarrow("parquet")
    parquet = pa_parquet.ParquetFile(path)
    for group in row_groups:
        first_row = sum(parquet.metadata.row_group(g).num_rows for g in range(group))
        batches = parquet.iter_batches(
            batch_size=_BATCH_ROWS, row_groups=[group], columns=[field], use_threads=False
        )
        for batch in batches:
            start = first_row

            def row_of(i: int, start: int = start) -> str:
                return f"row {start + i}"

            yield from _row_texts(batch.column(0), path, field, row_of)
            first_row += batch.num_rows
