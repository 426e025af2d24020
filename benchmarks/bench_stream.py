"""Training from a prepared dataset streamed out of an S3 server against the same dataset on local disk, through a
shard cache that has to evict.

A real S3-compatible server (moto's, over HTTP on 127.0.0.1, in this process) holds a sharded prepared corpus.
`gaudi3 train` runs on it twice over, alternated in fresh processes: `data.source` = the local prepared directory
(memmaps) and `data.source` = `s3://…` through the shard cache (shards are fetched ahead of the sampler, verified,
evicted). Steady-state tokens/s come from each run's summary.json, and from each streamed run its cache's evictions,
shards and bytes fetched and fetch wait.

The cache holds at most a quarter of what a run reads. Before anything runs, the shards each run reads are computed
from its own config the way training builds them (its sampler's windows over all its steps, in the shuffle block the
stream uses, and its final validation's windows), and a shape whose cache would hold more is refused; a streamed run
that evicted nothing fails the benchmark. Hence the tiny shards (<= 470 bytes, 125-170 windows of the default run's
64 tokens): its 300 steps read 26 of them through a cache of 5, so the stream fetches a shard every ~12 steps, far
more churn than production shards of many MB give. Both sides train on the stream's shuffle block, so they read the same
samples (the JSON says whether their train losses are equal).

`--outage-s S` adds the fault test: one streamed run as the reference, one where the server is stopped for S
seconds once training has passed `--outage-at-step` (it restarts with its data: a store that comes back). Both
save a checkpoint at the end, compared the way `gaudi3 ckpt diff` compares (weights, optimizer, RNG, data
position): they must be bitwise equal, and the run must have waited, not failed.

Progress: a bar over the runs (with ETA) and one over the steps of the run in progress (from its metrics.jsonl);
when stdout is not a terminal, which shows no bars, a line per finished run and one every 30 s while a run goes on.

    python benchmarks/bench_stream.py                       # the default run, writes results/stream_cpu.json
    python benchmarks/bench_stream.py --only outage --outage-s 30
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the S3 test server
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn  # noqa: E402

from bench_args import positive_int  # noqa: E402
from gaudi3_scale.bench.result import write_json_atomic  # noqa: E402
from gaudi3_scale.config.errors import UserInputError  # noqa: E402
from gaudi3_scale.data import DataConfig, prepare_dataset  # noqa: E402
from gaudi3_scale.data.manifest import load_manifest  # noqa: E402
from gaudi3_scale.data.publish import publish_prepared  # noqa: E402
from gaudi3_scale.data.sources import bundled_corpora  # noqa: E402
from gaudi3_scale.monitor.environment import environment_info  # noqa: E402
from s3_server import S3Server, free_port, s3_options  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BUCKET = "bench-stream"
# (label, model overrides, steps, warm-up steps): the README's default run shape, and GPT-2 124M on CPU (whose 24
# steps read too few windows to make any cache evict: refused unless --steps and the shard size make them).
CONFIGS: dict[str, tuple[list[str], int, int]] = {
    "default": ([], 300, 20),
    "gpt2-124m": (["--model.name", "gpt2-124m", "--model.context_length", "256", "--train.micro_batch_size", "4",
                   "--train.global_batch_size", "4"], 24, 4),
}  # fmt: skip
CACHE_SHARDS = 5  # the default cache: this many of the largest shard
READ_OVER_CACHE = 4  # a run reads at least 4x what the cache holds, so it cannot keep what it has read
HEARTBEAT_S = 30.0
CACHE_KEYS = ("evictions", "shards_fetched", "bytes_fetched", "fetch_wait_s")


def _env(port: int) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "eu-west-1"}  # fmt: skip


def run_overrides(source: str, extra: list[str], steps: int, warmup: int, cache: Path, cache_gib: float,
                  checkpoint: bool = False) -> list[str]:  # fmt: skip
    """The config of one run, as `gaudi3 train` overrides (what `planned_reads` resolves too)."""
    return ["--train.threads", "2", "--data.source", source, "--train.max_steps", str(steps),
            "--train.throughput_warmup_steps", str(warmup), "--train.val_every_steps", "0", "--train.log_every_steps",
            "5", "--data.cache_dir", str(cache), "--data.cache_limit_gib", str(cache_gib),
            "--checkpoint.enabled", str(checkpoint).lower(), "--checkpoint.every_steps", str(steps), *extra]  # fmt: skip


def train(out: Path, overrides: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """`gaudi3 train` in the background; its output goes to `<out>.log` (a pipe nobody reads could fill up)."""
    cmd = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--resume", "never", "--no-progress",
           "--sample-tokens", "0", *overrides]  # fmt: skip
    with out.with_name(f"{out.name}.log").open("w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


def planned_reads(local: Path, url: str, overrides: list[str]) -> dict[str, Any]:
    """What a run with these overrides reads, computed as training builds it: the stream's shuffle block, the shards
    its sampler's windows fall in over all its steps, and those its final validation reads."""
    from gaudi3_scale.data.datamodule import TokenDataModule
    from gaudi3_scale.data.inputs import TrainingData, remote_block_shards, training_data_from_dir
    from gaudi3_scale.data.loader import ValWindowDataset
    from gaudi3_scale.train.config import resolve_config

    cfg = resolve_config(None, overrides)
    manifest = load_manifest(local)
    block = remote_block_shards(cfg.data, manifest, url)
    member = training_data_from_dir(local, block_shards=block)
    plan = cfg.batch_plan(1)
    data = TokenDataModule(TrainingData(members=[member]), context_length=cfg.model.context_length,
                           global_batch_size=plan.global_batch_size, micro_batch_size=plan.micro_batch_size,
                           seed=cfg.seed, val_batches=cfg.train.val_batches)  # fmt: skip
    train_starts = data.build_sampler(1, 0).steps_starts(0, cfg.train.max_steps).ravel()
    val_starts = cast(ValWindowDataset, data.val_dataloader().dataset).starts
    read = {"train": np.unique(member.train.locate(train_starts)[0]).tolist(),
            "val": np.unique(member.val.locate(np.concatenate(val_starts))[0]).tolist() if val_starts else []}  # fmt: skip
    sizes = {split: [s.size_bytes for s in manifest.shards_of(split)] for split in read}
    return {"block_shards": block, "train_shards": len(read["train"]), "val_shards": len(read["val"]),
            "bytes": sum(sizes[split][i] for split, shards in read.items() for i in shards)}  # fmt: skip


def _last_step(metrics: Path) -> int:
    """The last step a run logged (its metrics.jsonl may end in a line being written)."""
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    for line in reversed(lines):
        try:
            return int(json.loads(line).get("step", 0))
        except ValueError:
            continue
    return 0


def follow(proc: subprocess.Popen[str], out: Path, name: str, steps: int, progress: Progress,
           until_step: int | None = None) -> int:  # fmt: skip
    """Show the run's steps on a bar until it exits (or logs `until_step`); the last step seen. Without a terminal,
    which shows no bar, a line every HEARTBEAT_S instead: a long run is visibly alive either way."""
    task = progress.add_task(f"  {name}: steps", total=steps)
    started_s = printed_s = time.monotonic()
    step = 0
    try:
        while proc.poll() is None and (until_step is None or step < until_step):
            step = _last_step(out / "metrics.jsonl")
            progress.update(task, completed=step)
            if not progress.console.is_terminal and time.monotonic() - printed_s >= HEARTBEAT_S:
                elapsed_s = time.monotonic() - started_s
                progress.console.print(f"{name}: step {step}/{steps} after {elapsed_s:.0f} s", soft_wrap=True)
                printed_s = time.monotonic()
            time.sleep(0.2)
    finally:
        progress.remove_task(task)
    return step


def finish(
    proc: subprocess.Popen[str], out: Path, name: str, steps: int, progress: Progress
) -> dict[str, Any]:
    follow(proc, out, name, steps, progress)
    if proc.wait() != 0:
        log = out.with_name(f"{out.name}.log").read_text()
        raise SystemExit(f"{name}: training failed ({proc.returncode}):\n{log[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    waits = [r["data_wait_s"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if r.get("data_wait_s") is not None]  # fmt: skip
    return summary | {
        "data_wait_s_max": max(waits, default=None),
        "data_wait_s_mean": statistics.fmean(waits),
    }


def _run_record(summary: dict[str, Any]) -> dict[str, Any]:
    keys = ("tokens_per_s", "step_time_s", "train_loss", "data_wait_s_mean", "data_wait_s_max", "data_cache")
    return {key: summary.get(key) for key in keys}


def _shape(
    label: str, steps: int | None, local: Path, url: str, tmp: Path, cache_gib: float
) -> dict[str, Any]:
    """A throughput config with its steps and what its runs read; refused (exit 1) when its cache would hold more
    than 1/READ_OVER_CACHE of that: a run it does not have to evict in measures nothing about streaming."""
    extra, default_steps, default_warmup = CONFIGS[label]
    steps = steps or default_steps
    warmup = min(default_warmup, steps // 4)
    cache_bytes = int(cache_gib * 2**30)
    try:
        reads = planned_reads(local, url, run_overrides(url, extra, steps, warmup, tmp / "cache", cache_gib))
    except UserInputError as e:  # e.g. shards shorter than the config's context
        raise SystemExit(f"{label}: {e}") from None
    reads |= {"cache_limit_bytes": cache_bytes, "cache_over_reads": cache_bytes / reads["bytes"]}
    if reads["bytes"] < READ_OVER_CACHE * cache_bytes:
        raise SystemExit(f"{label}: {steps} steps read {reads['bytes']:,} bytes ({reads['train_shards']} train and "
                         f"{reads['val_shards']} val shards), less than {READ_OVER_CACHE}x the {cache_bytes:,}-byte "
                         "cache: nothing would have to be evicted; lower --cache-mib or --shard-mb, or raise --steps")  # fmt: skip
    return {"extra": extra, "steps": steps, "warmup": warmup, "reads": reads}


def throughput(tmp: Path, local: Path, url: str, env: dict[str, str], cache_gib: float, shapes: dict[str, Any],
               repeats: int, progress: Progress, runs_task: Any) -> dict[str, Any]:  # fmt: skip
    results: dict[str, Any] = {}
    for label, shape in shapes.items():
        runs: dict[str, list[dict[str, Any]]] = {"local": [], "stream": []}
        for i in range(repeats):
            for side, source in (("local", str(local)), ("stream", url)):
                name = f"{label} #{i} {side}"
                progress.update(runs_task, description=name)
                out, cache = tmp / f"{label}-{side}-{i}", tmp / f"cache-{label}-{i}"
                overrides = run_overrides(
                    source, shape["extra"], shape["steps"], shape["warmup"], cache, cache_gib
                )
                block = ["--data.shuffle_block_shards", str(shape["reads"]["block_shards"])]
                summary = finish(train(out, [*overrides, *block], env), out, name, shape["steps"], progress)
                runs[side].append(_run_record(summary))
                cached = summary.get("data_cache") or {}
                counts = "".join(f", {k} {cached[k]:,}" if isinstance(cached[k], int) else f", {k} {cached[k]:.3f}"
                                 for k in CACHE_KEYS if k in cached)  # fmt: skip
                progress.console.print(
                    f"{name}: {summary['tokens_per_s']:,.0f} tokens/s{counts}", soft_wrap=True
                )
                progress.advance(runs_task)
        results[label] = _label_result(label, shape["reads"], runs)
    return results


def _label_result(label: str, reads: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med = {side: statistics.median(r["tokens_per_s"] for r in rs) for side, rs in runs.items()}
    cache = {key: statistics.median(r["data_cache"][key] for r in runs["stream"]) for key in CACHE_KEYS}
    fewest_evictions = min(r["data_cache"]["evictions"] for r in runs["stream"])
    if fewest_evictions == 0:
        raise SystemExit(f"{label}: a streamed run evicted nothing although it reads {reads['bytes']:,} bytes "
                         f"through a {reads['cache_limit_bytes']:,}-byte cache: {runs['stream']}")  # fmt: skip
    losses = {r["train_loss"] for rs in runs.values() for r in rs}
    # Each stream run over the local run just before it (they alternate): a noisy machine moves both of a pair
    pairs = [
        s["tokens_per_s"] / loc["tokens_per_s"] for loc, s in zip(runs["local"], runs["stream"], strict=True)
    ]
    print(f"{label:10s} local {med['local']:10,.0f} tok/s  stream {med['stream']:10,.0f} tok/s  ratio "
          f"{med['stream'] / med['local']:.3f} (pairs {min(pairs):.3f}–{max(pairs):.3f}, median "
          f"{statistics.median(pairs):.3f}); read {reads['bytes']:,} bytes in {reads['train_shards']} + "
          f"{reads['val_shards']} shards through a {reads['cache_limit_bytes']:,}-byte cache: "
          f"{cache['evictions']:.0f} evictions, fetch wait {cache['fetch_wait_s']:.3f} s (medians)")  # fmt: skip
    return {
        "reads": reads,
        "runs": runs,
        "tokens_per_s": med,
        "stream_over_local": med["stream"] / med["local"],
        "pair_ratios": pairs,
        "median_pair_ratio": statistics.median(pairs),
        "stream_cache": cache,
        "same_train_loss": len(losses) == 1,
    }


def outage(tmp: Path, url: str, server: S3Server, env: dict[str, str], cache_gib: float, outage_s: float,
           at_step: int, steps: int, progress: Progress, runs_task: Any) -> dict[str, Any]:  # fmt: skip
    from gaudi3_scale.checkpoint.inspect import first_difference
    from gaudi3_scale.checkpoint.reader import read_checkpoint
    from gaudi3_scale.cli.ckpt_cmd import DIFF_KEYS

    summaries, checkpoints = {}, {}
    for name in ("reference", "outage"):
        progress.update(runs_task, description=f"outage: {name}")
        out = tmp / f"outage-{name}"
        started = time.perf_counter()
        cache = tmp / f"cache-outage-{name}"
        proc = train(out, run_overrides(url, [], steps, 20, cache, cache_gib, checkpoint=True), env)
        stopped_at = None
        if name == "outage":
            follow(proc, out, name, steps, progress, until_step=at_step)
            server.stop()
            stopped_at = time.perf_counter() - started
            progress.console.print(f"object store stopped at {stopped_at:.1f} s for {outage_s:.0f} s")
            time.sleep(outage_s)
            server.start()
        summaries[name] = finish(proc, out, f"outage: {name}", steps, progress) | {
            "wall_s": time.perf_counter() - started,
            "stopped_at_s": stopped_at,
        }
        checkpoints[name] = Path(summaries[name]["checkpoint"])
        progress.advance(runs_task)
    diff = first_difference(
        *(read_checkpoint(checkpoints[n]) for n in ("reference", "outage")), keys=DIFF_KEYS
    )
    result = {"outage_s": outage_s, "at_step": at_step, "steps": steps, "bitwise_equal": diff is None,
              "first_difference": diff, "summaries": summaries}  # fmt: skip
    print(f"outage of {outage_s:.0f} s: final checkpoint bitwise equal to the reference: {diff is None}; wall "
          f"{summaries['reference']['wall_s']:.1f} s → {summaries['outage']['wall_s']:.1f} s")  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--corpus-mb", type=float, default=0.05, help="MB of tinyshakespeare's text (it has 1.1)"
    )
    parser.add_argument("--shard-mb", type=float, default=0.0002, help="data.shard_mb of the prepared corpus")
    parser.add_argument("--cache-mib", type=float, default=None,
                        help=f"data.cache_limit_gib, in MiB (default: {CACHE_SHARDS} of the largest shard)")  # fmt: skip
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument(
        "--steps", type=positive_int, default=None, help="steps of every throughput run (default: its own)"
    )
    parser.add_argument("--only", default="default", help="comma-separated: default, gpt2-124m, outage")
    parser.add_argument("--outage-s", type=float, default=30.0)
    parser.add_argument("--outage-at-step", type=int, default=60)
    parser.add_argument("--outage-steps", type=int, default=400)
    parser.add_argument("--out", type=Path, default=RESULTS / "stream_cpu.json")
    args = parser.parse_args()
    only = args.only.split(",")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server(free_port())
    server.start()
    env = _env(server.port)
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        os.environ[key] = env[key]
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results.update(
        benchmark="bench_stream", machine=environment_info(), args={k: str(v) for k, v in vars(args).items()}
    )
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp_name, progress:
        tmp = Path(tmp_name)
        corpus = tmp / "corpus.txt"
        corpus.write_text(bundled_corpora()["tinyshakespeare"].read_text()[: int(args.corpus_mb * 1e6)])
        local = prepare_dataset(
            DataConfig(source=str(corpus), shard_mb=args.shard_mb), tmp / "prepared", progress=False
        )
        manifest = load_manifest(local)
        from gaudi3_scale.storage import open_remote

        fs, _ = open_remote(f"s3://{BUCKET}", s3_options(server.port), field="bench")
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        url = publish_prepared(local, f"s3://{BUCKET}/corpus")
        dataset_bytes = sum(s.size_bytes for s in manifest.shards)
        largest = max(s.size_bytes for s in manifest.shards)
        cache_bytes = int(args.cache_mib * 2**20) if args.cache_mib is not None else CACHE_SHARDS * largest
        cache_gib = cache_bytes / 2**30
        results["dataset"] = {"shards": len(manifest.shards), "bytes": dataset_bytes, "largest_shard_bytes": largest,
                              "tokens": manifest.num_tokens, "cache_limit_bytes": cache_bytes}  # fmt: skip
        progress.console.print(f"dataset: {len(manifest.shards)} shards, {dataset_bytes:,} bytes (largest "
                               f"{largest:,}); cache {cache_bytes:,} bytes")  # fmt: skip
        shapes = {
            label: _shape(label, args.steps, local, url, tmp, cache_gib) for label in only if label in CONFIGS
        }
        runs = len(shapes) * args.repeats * 2 + 2 * ("outage" in only)
        runs_task = progress.add_task("runs", total=runs)
        if shapes:
            results["throughput"] = throughput(tmp, local, url, env, cache_gib, shapes, args.repeats, progress,
                                               runs_task)  # fmt: skip
        if "outage" in only:
            results["outage"] = outage(tmp, url, server, env, cache_gib, args.outage_s, args.outage_at_step,
                                       args.outage_steps, progress, runs_task)  # fmt: skip
    server.stop()
    write_json_atomic(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    threading.current_thread().name = "bench_stream"
    main()
