"""How fast `prepare_dataset` tokenizes, with 1 worker vs N, and what the training loader costs per batch.

Builds a deterministic corpus of >= --size-mb MB by shuffling lines of the bundled tinyshakespeare into files of
--file-mb MB (default: 16 files) in a temp directory, so that pieces (prepare's unit of parallel work, at most
data.shard_mb of one file) spread over the workers. Prepares it with the char and byte tokenizers using 1 worker
(in-process) and --workers processes (after an untimed warm-up, repeats interleaved, best of --repeats), checks
both give bit-identical shards, and times the no-op re-run. BPE is measured too, on the first --bpe-size-mb MB
with a tokenizer.json trained beforehand (encoding, not training, is what workers parallelize; it is ~100x slower
per byte than char/byte). Finally it times TokenWindowDataset batches on the first train shard. Results (MB/s,
tokens/s, speedup, the load average before each run) are printed and saved as JSON with machine info.

    python benchmarks/bench_prepare.py                      # 50 MB, 1 vs 2 workers -> results/prepare.json
    python benchmarks/bench_prepare.py --size-mb 1024 --repeats 2   # 16 x 64 MB -> results/prepare_1gb.json
    python benchmarks/bench_prepare.py --size-mb 200 --workers 8
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.data import (
    DataConfig,
    TokenWindowDataset,
    WindowSampler,
    build_tokenizer,
    load_prepared,
    prepare_dataset,
)
from gaudi3_scale.data.sources import bundled_corpora
from gaudi3_scale.monitor.environment import environment_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int

MB = 1e6


def build_corpus(directory: Path, size_mb: float, file_mb: float, seed: int = 0) -> Path:
    """Whole shuffled copies of tinyshakespeare's lines in ``corpus/part-NNN.txt`` files of >= `file_mb` MB each,
    until they hold at least `size_mb` MB together."""
    lines = bundled_corpora()["tinyshakespeare"].read_text(encoding="utf-8").splitlines(keepends=True)
    rng = random.Random(seed)
    root = directory / "corpus"
    root.mkdir()
    total = 0
    for index in range(max(1, math.ceil(size_mb / file_mb))):
        size = 0
        with (root / f"part-{index:03d}.txt").open("w", encoding="utf-8") as fh:
            while size < file_mb * MB and total + size < size_mb * MB:
                rng.shuffle(lines)
                chunk = "".join(lines)
                fh.write(chunk)
                size += len(chunk.encode("utf-8"))
        total += size
    return root


def corpus_bytes(source: Path) -> int:
    return sum(p.stat().st_size for p in source.iterdir()) if source.is_dir() else source.stat().st_size


def head_of(corpus: Path, size_mb: float) -> Path:
    """The first `size_mb` MB of the corpus files (in order, concatenated), cut after a newline."""
    text = b""
    for part in sorted(corpus.iterdir()):
        if len(text) >= size_mb * MB:
            break
        text += part.read_bytes()[: int(size_mb * MB) - len(text)]
    path = corpus.with_name("corpus-head.txt")
    path.write_bytes(text[: text.rfind(b"\n") + 1])
    return path


def train_bpe(directory: Path, vocab_size: int = 2048) -> Path:
    text = bundled_corpora()["tinyshakespeare"].read_text(encoding="utf-8")
    directory.mkdir()
    return build_tokenizer("bpe", [text], vocab_size=vocab_size).save(directory)


_TIMED_PREPARE = """
import sys, time
from pathlib import Path
from gaudi3_scale.data import DataConfig, prepare_dataset
source, tokenizer, shard_mb, out, workers, progress = sys.argv[1:]
cfg = DataConfig(source=source, tokenizer=tokenizer, shard_mb=float(shard_mb))
start = time.perf_counter()
prepare_dataset(cfg, Path(out), workers=int(workers), progress=progress == "1", force=True)
print(time.perf_counter() - start)
"""


def prepare_once(cfg: DataConfig, out: Path, workers: int, progress: bool) -> float:
    """Seconds of one full prepare into an empty `out`, in a fresh process as `gaudi3 prepare` runs (interpreter
    start-up not counted), so 1 worker in-process gets no memory warmed by earlier runs that N fresh workers lack.
    Dirty pages of earlier runs are flushed first (untimed), so that no run pays for another's writeback."""
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    LOAD_BEFORE_RUNS.append(os.getloadavg()[0])  # this machine may be shared: a busy run shows here
    args = [cfg.source, cfg.tokenizer, str(cfg.shard_mb), str(out), str(workers), "1" if progress else "0"]
    done = subprocess.run(
        [sys.executable, "-c", _TIMED_PREPARE, *args], stdout=subprocess.PIPE, text=True, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


LOAD_BEFORE_RUNS: list[float] = []


def summarize(cfg: DataConfig, out: Path, workers: int, times: list[float]) -> dict[str, Any]:
    seconds = min(times)
    data = load_prepared(out, verify_checksums=False)
    num_tokens = sum(data.manifest.num_tokens.values())
    source_bytes = corpus_bytes(Path(cfg.source))
    start = time.perf_counter()
    prepare_dataset(cfg, out, workers=workers, progress=False)  # unchanged inputs: must be a no-op
    noop_s = time.perf_counter() - start
    return {
        "tokenizer": data.manifest.tokenizer_kind,
        "workers": workers,
        "seconds": seconds,
        "seconds_all_repeats": times,
        "source_mb": source_bytes / MB,
        "mb_per_s": source_bytes / MB / seconds,
        "tokens": num_tokens,
        "tokens_per_s": num_tokens / seconds,
        "shards": len(data.manifest.shards),
        "noop_rerun_s": noop_s,
        "shard_sha256": [s.sha256 for s in data.manifest.shards],
    }


def time_loader(directory: Path, micro: int, context: int, accum: int, batches: int) -> dict[str, Any]:
    """Seconds per micro-batch of TokenWindowDataset (sampler + gather + tensors), and of the sampler alone."""
    train = load_prepared(directory, verify_checksums=False).train_shards[0]  # the loader reads one shard yet
    sampler = WindowSampler(
        len(train), context, global_batch_size=micro * accum, micro_batch_size=micro, seed=0
    )
    stream = iter(TokenWindowDataset(train, sampler))
    for _ in range(20):  # page in, warm caches
        next(stream)
    start = time.perf_counter()
    for _ in range(batches):
        next(stream)
    per_batch_s = (time.perf_counter() - start) / batches
    steps = max(1, batches // accum)
    start = time.perf_counter()
    for step in range(steps):
        sampler.step_starts(step)
    sampler_per_batch_s = (time.perf_counter() - start) / (steps * accum)
    return {
        "micro_batch_size": micro,
        "context_length": context,
        "accum_steps": accum,
        "per_batch_us": per_batch_s * 1e6,
        "sampler_per_batch_us": sampler_per_batch_s * 1e6,
        "batch_mb": micro * context * 8 * 2 / MB,  # x and y, int64
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=50.0)
    parser.add_argument(
        "--file-mb",
        type=float,
        default=None,
        help="size of each corpus file (default: 1/16 of it, at most 64)",
    )
    parser.add_argument("--workers", type=positive_int, default=2)
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="prepare runs per setting, interleaved; the fastest counts",
    )
    parser.add_argument("--bpe-size-mb", type=float, default=10.0, help="0 skips BPE")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed prepare runs per setting and worker count first"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide prepare's progress bars")
    parser.add_argument(
        "--out", type=Path, default=None, help="default results/prepare.json, _1gb for >= 1 GB"
    )
    args = parser.parse_args()
    if args.file_mb is None:  # 16 files: pieces (<= data.shard_mb, 64 MiB, of one file) for up to 16 workers
        args.file_mb = min(64.0, args.size_mb / 16)
    if args.out is None:
        name = "prepare_1gb.json" if args.size_mb >= 1000 else "prepare.json"
        args.out = Path(__file__).parent / "results" / name

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        corpus = build_corpus(Path(tmp), args.size_mb, args.file_mb)
        files = len(list(corpus.iterdir()))
        print(f"corpus: {corpus_bytes(corpus) / MB:.1f} MB in {files} file(s), {os.cpu_count()} CPUs")
        settings = [("char", "char", corpus), ("byte", "byte", corpus)]
        if args.bpe_size_mb > 0:
            bpe_file = str(train_bpe(Path(tmp) / "bpe-2048"))
            settings.append(("bpe", bpe_file, head_of(corpus, args.bpe_size_mb)))
        for name, tok, source in settings:
            # The BPE head is one small file: smaller pieces (not below the 2 MiB byte ranges) let workers share it.
            shard_mb = max(2.0, args.bpe_size_mb / 4) if name == "bpe" else DataConfig().shard_mb
            cfg = DataConfig(source=str(source), tokenizer=tok, shard_mb=shard_mb)
            outs = {w: Path(tmp) / f"{name}-w{w}" for w in (1, args.workers)}
            times: dict[int, list[float]] = {w: [] for w in outs}
            for _ in range(args.warmup):
                # Untimed, each worker count: memory a process touches for the first time is slow to fault in on
                # a VM (the host backs it then), which would bill the first timed run for it.
                for workers, out in outs.items():
                    prepare_once(cfg, out, workers, progress=False)
            for _ in range(args.repeats):  # interleaved: a load change on the machine hits both alike
                for workers, out in outs.items():
                    times[workers].append(prepare_once(cfg, out, workers, not args.no_progress))
            for workers, out in outs.items():
                run = summarize(cfg, out, workers, times[workers])
                runs.append(run)
                print(
                    f"{name:>5} workers={workers}: {run['seconds']:6.2f} s  {run['mb_per_s']:6.1f} MB/s  "
                    f"{run['tokens_per_s'] / 1e6:6.2f} M tokens/s  no-op re-run {run['noop_rerun_s'] * 1e3:.1f} ms"
                )
        speedups = {}
        for name, _, _ in settings:
            one, many = (r for r in runs if r["tokenizer"] == name)
            assert one["shard_sha256"] == many["shard_sha256"], f"{name}: worker count changed the output"
            speedups[name] = one["seconds"] / many["seconds"]
            print(f"{name:>5} speedup {args.workers} workers / 1: {speedups[name]:.2f}x (identical shards)")
        loader = [
            time_loader(Path(tmp) / "char-w1", micro, context, accum, batches=2000)
            for micro, context, accum in ((12, 1024, 40), (64, 256, 1), (8, 64, 4))
        ]
        for row in loader:
            print(
                f"loader micro={row['micro_batch_size']:>3} T={row['context_length']:>5}: "
                f"{row['per_batch_us']:6.1f} us/batch (sampler {row['sampler_per_batch_us']:.1f} us)"
            )

    result = {
        "machine": environment_info(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": {"prepare": runs, "loader": loader},
        "speedup_workers_over_1": speedups,
        "noop_rerun_max_s": max(r["noop_rerun_s"] for r in runs),
        "load_avg_1min_before_each_run": LOAD_BEFORE_RUNS,
        "loader_median_per_batch_us": statistics.median(r["per_batch_us"] for r in loader),
    }
    write_json_atomic(args.out, result)
    print(f"saved {args.out}")


if __name__ == "__main__":  # required: prepare's workers are spawned and re-import this file
    main()
