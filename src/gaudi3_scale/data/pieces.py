"""Pieces: prepare's unit of parallel work, each becoming shard i of both splits.

A piece is a run of consecutive parts of ONE source file holding about ``data.shard_mb`` MiB of text: ~2 MiB byte
ranges cut after newlines for text and JSON lines (`sources.split_into_chunks`), whole row groups for Parquet (sized
by the text column's uncompressed bytes). A piece closes once it holds at least ``shard_mb`` MiB, and never spans
two files, so appending a file appends pieces. Planning reads only a few KiB around each cut (and Parquet footers);
it does not depend on the worker count, so any number of workers gives the same shards.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gaudi3_scale.data.formats import (
    JSONL,
    PARQUET,
    check_jsonl_field,
    jsonl_texts,
    parquet_row_group_sizes,
    parquet_texts,
    source_format,
)
from gaudi3_scale.data.sources import CHUNK_BYTES, Chunk, SourceFile, read_chunk, split_into_chunks

__all__ = ["MIB", "Piece", "chunk_bytes_for", "piece_texts", "plan_pieces"]

MIB = 1 << 20


@dataclass(frozen=True)
class Piece:
    index: int  # its shard index: train-{index:05d}.bin / val-{index:05d}.bin
    source_index: int  # position of its file in the source list
    path: str
    kind: str  # formats.TEXT / JSONL / PARQUET
    ranges: tuple[tuple[int, int], ...] = ()  # (offset, length) byte ranges, text and JSONL
    row_groups: tuple[int, ...] = ()  # Parquet
    size_bytes: int = 0  # text bytes (Parquet: uncompressed column bytes), for progress and balance


def chunk_bytes_for(shard_mb: float) -> int:
    """Byte ranges are ~2 MiB, smaller only when a whole piece is (a tiny shard_mb, as tests use)."""
    return max(1, min(CHUNK_BYTES, int(shard_mb * MIB)))


def plan_pieces(
    files: Sequence[SourceFile],
    shard_mb: float,
    text_field: str,
    *,
    first_index: int = 0,
    first_source: int = 0,
) -> list[Piece]:
    """The pieces of `files` in order; indices count on from `first_index` (an append continues a dataset)."""
    pieces: list[Piece] = []
    for offset, file in enumerate(files):
        source_index = first_source + offset
        kind = source_format(file.path)
        ranges: list[tuple[int, int]] = []
        if kind == PARQUET:
            sizes = parquet_row_group_sizes(str(file.path), text_field)
        else:
            if kind == JSONL:
                check_jsonl_field(str(file.path), text_field)
            chunk_bytes = chunk_bytes_for(shard_mb)
            chunks = split_into_chunks(
                source_index, file.path, file.size_bytes, chunk_bytes, whole_lines=kind == JSONL
            )
            ranges = [(c.offset_bytes, c.length_bytes) for c in chunks]
            sizes = [length for _, length in ranges]
        for span in _group(sizes, shard_mb * MIB):
            parquet = kind == PARQUET
            pieces.append(
                Piece(
                    index=first_index + len(pieces),
                    source_index=source_index,
                    path=str(file.path),
                    kind=kind,
                    ranges=() if parquet else tuple(ranges[i] for i in span),
                    row_groups=tuple(span) if parquet else (),
                    size_bytes=sum(sizes[i] for i in span),
                )
            )
    return pieces


def _group(sizes: list[int], target_bytes: float) -> list[range]:
    """Consecutive index runs, each closed once it holds `target_bytes`."""
    spans: list[range] = []
    start = total = 0
    for i, size in enumerate(sizes):
        total += size
        if total >= target_bytes:
            spans.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        spans.append(range(start, len(sizes)))
    return spans


def piece_texts(piece: Piece, text_field: str) -> Iterator[str]:
    """The piece's text in order, a few MiB at a time (what one `encode_array` call takes)."""
    if piece.kind == PARQUET:
        yield from _batched(parquet_texts(piece.path, piece.row_groups, text_field))
        return
    for offset, length in piece.ranges:
        if piece.kind == JSONL:
            yield "".join(jsonl_texts(piece.path, offset, length, text_field))
        else:
            yield read_chunk(Chunk(piece.source_index, piece.path, offset, length))


def _batched(rows: Iterator[str]) -> Iterator[str]:
    batch: list[str] = []
    size = 0
    for row in rows:
        batch.append(row)
        size += len(row)
        if size >= CHUNK_BYTES:
            yield "".join(batch)
            batch, size = [], 0
    if batch:
        yield "".join(batch)
