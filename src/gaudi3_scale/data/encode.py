"""Prepare's heavy lifting: tokenize chunks in worker processes, then cut documents into train / val shards.

Each chunk (~2 MiB, cut after a newline) is tokenized by a worker that writes its tokens to
``.partial/chunks/<index>.bin`` and returns only the count, so no token data crosses a pipe; ``imap`` keeps the
order. Chunking does not depend on the worker count, so any number of workers produces bit-identical shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from gaudi3_scale.data.manifest import Shard, numpy_dtype
from gaudi3_scale.data.sources import Chunk, read_chunk
from gaudi3_scale.data.tokenizers import Tokenizer, load_tokenizer_file

__all__ = [
    "EncodeTask",
    "OrderedMap",
    "chunk_alphabet",
    "encode_chunk",
    "ordered_map",
    "progress_bar",
    "tracked",
    "write_shard",
    "write_splits",
]

T = TypeVar("T")
R = TypeVar("R")
OrderedMap = Callable[[Callable[[T], R], Iterable[T]], Iterator[R]]

# Module-level state and functions: what a worker process runs must be importable by name (spawn pickles it).

_WORKER_TOKENIZERS: dict[str, Tokenizer] = {}


@dataclasses.dataclass(frozen=True)
class EncodeTask:
    chunk: Chunk
    tokenizer_path: str
    tokenizer_key: str  # SHA-256 of the tokenizer JSON: a worker loads each tokenizer once
    dtype: str
    out_path: str  # the worker writes the chunk's tokens here; only their count travels back


def encode_chunk(task: EncodeTask) -> int:
    tok = _WORKER_TOKENIZERS.get(task.tokenizer_key)
    if tok is None:
        _WORKER_TOKENIZERS.clear()
        tok = _WORKER_TOKENIZERS[task.tokenizer_key] = load_tokenizer_file(Path(task.tokenizer_path))
    ids = tok.encode_array(read_chunk(task.chunk)).astype(numpy_dtype(task.dtype), copy=False)
    ids.tofile(task.out_path)
    return len(ids)


def chunk_alphabet(chunk: Chunk) -> str:
    """The distinct characters of a chunk, as one string: all the char tokenizer needs to see."""
    code_points = np.frombuffer(read_chunk(chunk).encode("utf-32-le"), dtype=np.uint32)
    return np.flatnonzero(np.bincount(code_points)).astype("<u4").tobytes().decode("utf-32-le")


def _init_worker() -> None:
    # If the caller used Hugging Face tokenizers' thread pool before prepare, a forked child inherits that fact;
    # saying so up front keeps the library from printing its fork warning in every worker.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


@contextmanager
def ordered_map(workers: int) -> Iterator[OrderedMap[Any, Any]]:
    if workers == 1:
        yield map  # in-process: no start-up cost, and what a 1-worker benchmark should measure
        return
    # fork on Linux, as torch's DataLoader does: workers start in milliseconds instead of re-importing the
    # package (spawn) and work with any __main__ (spawn hangs re-running a `python -` script). The workers run
    # only numpy and tokenizers, and the pool is created before prepare starts its own threads.
    method = "fork" if sys.platform == "linux" else "spawn"
    with multiprocessing.get_context(method).Pool(workers, initializer=_init_worker) as pool:
        yield lambda fn, items: pool.imap(fn, items, chunksize=1)


def progress_bar(enabled: bool) -> Progress:
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=Console(stderr=True), disable=not enabled)


def tracked(results: Iterable[R], chunks: Sequence[Chunk], bar: Progress, description: str) -> Iterator[R]:
    task = bar.add_task(description, total=sum(c.length_bytes for c in chunks))
    bar.advance(task, 0)  # a first sample at t=0, else rich computes MB/s from the first two results only
    for chunk, result in zip(chunks, results, strict=False):
        bar.advance(task, chunk.length_bytes)
        yield result


# ---- train / val shards ------------------------------------------------------------------------------------


def write_splits(
    partial: Path, tasks: list[EncodeTask], counts: list[int], num_docs: int, val_fraction: float, seed: int
) -> list[Shard]:
    """Cut each document's tokens (spread over its chunk files) into train and val parts and write the shards."""
    dtype = numpy_dtype(tasks[0].dtype)
    docs: list[list[tuple[str, int]]] = [[] for _ in range(num_docs)]
    for task, count in zip(tasks, counts, strict=True):
        docs[task.chunk.doc_index].append((task.out_path, count))
    num_tokens = [sum(count for _, count in segments) for segments in docs]
    num_train = [int(n * (1 - val_fraction)) for n in num_tokens]
    order = np.random.default_rng(seed).permutation(num_docs).tolist() if num_docs > 1 else [0]
    train = (p for d in order for p in _read_range(docs[d], 0, num_train[d], dtype))
    val = (p for d in range(num_docs) for p in _read_range(docs[d], num_train[d], num_tokens[d], dtype))
    return [
        write_shard(partial / "train.bin", "train", train),
        write_shard(partial / "val.bin", "val", val),
    ]


def _read_range(
    segments: list[tuple[str, int]], start: int, end: int, dtype: np.dtype[Any]
) -> Iterator[np.ndarray]:
    """Tokens [start, end) of the concatenation of chunk files, one piece per file touched."""
    offset = 0
    for path, count in segments:
        lo, hi = max(start - offset, 0), min(end - offset, count)
        if lo < hi:
            yield np.fromfile(path, dtype=dtype, count=hi - lo, offset=lo * dtype.itemsize)
        offset += count


def write_shard(path: Path, split: str, pieces: Iterable[np.ndarray]) -> Shard:
    """Write token arrays back to back into one shard, hashing them on the way (also used by `synthetic`)."""
    digest = hashlib.sha256()
    num_tokens = size_bytes = 0
    with path.open("wb") as fh:
        for piece in pieces:
            fh.write(piece.data)
            digest.update(piece.data)
            num_tokens, size_bytes = num_tokens + len(piece), size_bytes + piece.nbytes
    return Shard(
        split=split, file=path.name, num_tokens=num_tokens, size_bytes=size_bytes, sha256=digest.hexdigest()
    )
