"""Prepare's heavy lifting, run in worker processes: a piece of source text in, its train and val shards out.

Each piece (see `pieces`) is read, tokenized, cut into train (the first ``int(n * (1 - val_fraction))`` of its n
tokens) and val (the rest), and written as ``train-<i>.bin`` / ``val-<i>.bin`` by one worker, which hashes the
shards as it writes them and returns only their `Shard` records: no token data crosses a pipe and the parent does
no per-byte work, so reading, encoding, writing and hashing all scale with the workers. Pieces do not depend on
the worker count, so any number of workers produces bit-identical shards.
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
from typing import Any, BinaryIO, TypeVar

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

from gaudi3_scale.data.manifest import SPLITS, Shard, SourceEntry, numpy_dtype, shard_file, token_dtype
from gaudi3_scale.data.pieces import Piece, piece_texts
from gaudi3_scale.data.sources import SourceFile, sha256_file
from gaudi3_scale.data.tokenizers import Tokenizer, load_tokenizer_file

__all__ = [
    "OrderedMap",
    "PieceTask",
    "encode_piece",
    "encode_pieces",
    "ordered_map",
    "piece_alphabet",
    "progress_bar",
    "scan_alphabets",
    "sha256_source",
    "source_entries",
    "tracked",
    "write_shard",
]

T = TypeVar("T")
R = TypeVar("R")
OrderedMap = Callable[[Callable[[T], R], Iterable[T]], Iterator[R]]

# Module-level state and functions: what a worker process runs must be importable by name (spawn pickles it).

_WORKER_TOKENIZERS: dict[str, Tokenizer] = {}


@dataclasses.dataclass(frozen=True)
class PieceTask:
    piece: Piece
    text_field: str
    tokenizer_path: str
    tokenizer_key: str  # SHA-256 of the tokenizer JSON: a worker loads each tokenizer once
    dtype: str
    val_fraction: float
    out_dir: str  # the worker writes the piece's two shards here


def encode_piece(task: PieceTask) -> tuple[Shard, Shard]:
    """Tokenize a piece and write its train and val shards; returns their records (counts and SHA-256)."""
    tok = _WORKER_TOKENIZERS.get(task.tokenizer_key)
    if tok is None:
        _WORKER_TOKENIZERS.clear()
        tok = _WORKER_TOKENIZERS[task.tokenizer_key] = load_tokenizer_file(Path(task.tokenizer_path))
    dtype = numpy_dtype(task.dtype)
    out = Path(task.out_dir)
    train_path = out / shard_file("train", task.piece.index)
    # Tokens stream into the train shard as soon as they are sure to be train: with n tokens seen so far, the
    # first int(n * (1 - val_fraction)) are, whatever follows (the cut only moves right). Only the tail that may
    # still become val waits in memory, ~val_fraction of a shard, so a worker touches little fresh memory.
    keep_fraction = 1 - task.val_fraction
    pending: list[np.ndarray] = []
    num_tokens = num_train = 0
    digest = hashlib.sha256()
    with train_path.open("wb") as fh:
        for text in piece_texts(task.piece, task.text_field):
            ids = tok.encode_array(text).astype(dtype, copy=False)
            pending.append(ids)
            num_tokens += len(ids)
            num_train = _write_until(pending, num_train, int(num_tokens * keep_fraction), fh, digest)
    train = Shard(
        split="train",
        file=train_path.name,
        num_tokens=num_train,
        size_bytes=num_train * dtype.itemsize,
        sha256=digest.hexdigest(),
    )
    return train, write_shard(out / shard_file("val", task.piece.index), "val", pending)


def _write_until(pending: list[np.ndarray], written: int, until: int, fh: BinaryIO, digest: Any) -> int:
    """Write and hash tokens from the front of `pending` until `until` tokens are written in all; returns that."""
    while pending and written < until:
        head = pending[0]
        part = head[: until - written]
        fh.write(part.data)
        digest.update(part.data)
        written += len(part)
        if len(part) == len(head):
            pending.pop(0)
        else:
            pending[0] = head[len(part) :]
    return written


def piece_alphabet(task: tuple[Piece, str]) -> str:
    """The distinct characters of a piece (`task` = piece, text field), as one string: all `char` needs to see."""
    piece, text_field = task
    ascii_seen = b""  # sorted distinct bytes of the ASCII texts so far
    present = np.zeros(0, dtype=bool)  # code points seen in the other texts
    for text in piece_texts(piece, text_field):
        if text.isascii():
            # Deleting the bytes already seen (bytes.translate, GB/s) leaves nothing in almost every chunk.
            rest = text.encode("ascii").translate(None, ascii_seen)
            if rest:
                new = np.flatnonzero(np.bincount(np.frombuffer(rest, dtype=np.uint8)))
                ascii_seen = bytes(sorted(set(ascii_seen) | set(new.tolist())))
            continue
        counts = np.bincount(np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32))
        if len(counts) > len(present):
            present = np.concatenate([present, np.zeros(len(counts) - len(present), dtype=bool)])
        present[: len(counts)] |= counts > 0
    others = np.flatnonzero(present).astype("<u4").tobytes().decode("utf-32-le")
    return "".join(sorted(set(ascii_seen.decode("ascii")) | set(others)))


def scan_alphabets(
    pieces: Sequence[Piece], text_field: str, pmap: OrderedMap[Any, Any], bar: Progress
) -> Iterator[str]:
    """Each piece's distinct characters, found by the workers."""
    tasks = [(p, text_field) for p in pieces]
    return tracked(pmap(piece_alphabet, tasks), [p.size_bytes for p in pieces], bar, "scan characters")


def encode_pieces(
    pieces: Sequence[Piece],
    out_dir: Path,
    tokenizer_path: Path,
    text_field: str,
    val_fraction: float,
    pmap: OrderedMap[Any, Any],
    bar: Progress,
) -> list[Shard]:
    """Every piece's train and val shard, written into `out_dir` by the workers: train shards first, in order."""
    tok_key = sha256_file(tokenizer_path)
    dtype = token_dtype(load_tokenizer_file(tokenizer_path).vocab_size)
    tasks = [
        PieceTask(p, text_field, str(tokenizer_path), tok_key, dtype, val_fraction, str(out_dir))
        for p in pieces
    ]
    sizes = [p.size_bytes for p in pieces]
    pairs = list(tracked(pmap(encode_piece, tasks), sizes, bar, "tokenize"))
    return [pair[i] for i in range(len(SPLITS)) for pair in pairs]


def source_entries(
    files: Sequence[SourceFile], hashes: list[str], pieces: Sequence[Piece]
) -> list[SourceEntry]:
    """Manifest entries of `files` (their pieces among `pieces`, which start at the first of them)."""
    first = pieces[0].source_index if pieces else 0
    return [
        SourceEntry(
            path=str(f.path),
            size_bytes=f.size_bytes,
            sha256=h,
            shards=[p.index for p in pieces if p.source_index == first + i],
        )
        for i, (f, h) in enumerate(zip(files, hashes, strict=True))
    ]


def sha256_source(path: str) -> str:
    return sha256_file(Path(path))


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


def tracked(results: Iterable[R], sizes: Sequence[int], bar: Progress, description: str) -> Iterator[R]:
    """Yield `results`, advancing a bar by the byte size of the item each one came from."""
    task = bar.add_task(description, total=sum(sizes))
    bar.advance(task, 0)  # a first sample at t=0, else rich computes MB/s from the first two results only
    for size, result in zip(sizes, results, strict=False):
        bar.advance(task, size)
        yield result


# ---- train / val shards ------------------------------------------------------------------------------------


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
