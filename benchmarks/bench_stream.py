"""Training from a prepared dataset streamed out of an S3 server against the same dataset on local disk.

A real S3-compatible server (moto's, over HTTP on 127.0.0.1, in this process) holds a sharded prepared corpus.
`gaudi3 train` runs on it twice over, alternated in fresh processes: `data.source` = the local prepared
directory (memmaps) and `data.source` = `s3://…` with a shard cache much smaller than the dataset (shards are
fetched ahead of the sampler, verified, evicted). Steady-state tokens/s come from each run's summary.json.

`--outage-s S` adds the fault test: one streamed run as the reference, one where the server is stopped for S
seconds once training has passed `--outage-at-step` (it restarts with its data: a store that comes back). Both
save a checkpoint at the end, compared the way `gaudi3 ckpt diff` compares (weights, optimizer, RNG, data
position): they must be bitwise equal, and the run must have waited, not failed.

    python benchmarks/bench_stream.py                       # default + gpt2-124m, writes results/stream_cpu.json
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the S3 test server
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn  # noqa: E402

from bench_prepare import build_corpus  # noqa: E402
from gaudi3_scale.data import DataConfig, prepare_dataset  # noqa: E402
from gaudi3_scale.data.manifest import load_manifest  # noqa: E402
from gaudi3_scale.data.publish import publish_prepared  # noqa: E402
from gaudi3_scale.monitor.environment import environment_info  # noqa: E402
from s3_server import S3Server, free_port, s3_options  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BUCKET = "bench-stream"
# (label, model overrides, steps, warm-up steps): the README's default run shape, and GPT-2 124M on CPU.
CONFIGS: dict[str, tuple[list[str], int, int]] = {
    "default": ([], 300, 20),
    "gpt2-124m": (["--model.name", "gpt2-124m", "--model.context_length", "256", "--train.micro_batch_size", "4",
                   "--train.global_batch_size", "4"], 24, 4),
}  # fmt: skip


def _env(port: int) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "eu-west-1"}  # fmt: skip


def train(out: Path, source: str, extra: list[str], steps: int, warmup: int, env: dict[str, str],
          cache: Path, cache_gib: float, checkpoint: bool = False) -> subprocess.Popen[str]:  # fmt: skip
    cmd = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--resume", "never", "--no-progress",
           "--sample-tokens", "0", "--train.threads", "2", "--data.source", source, "--train.max_steps", str(steps),
           "--train.throughput_warmup_steps", str(warmup), "--train.val_every_steps", "0", "--train.log_every_steps",
           "5", "--data.cache_dir", str(cache), "--data.cache_limit_gib", str(cache_gib),
           "--checkpoint.enabled", str(checkpoint).lower(), "--checkpoint.every_steps", str(steps), *extra]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"training failed ({proc.returncode}):\n{err[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    waits = [r["data_wait_s"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if r.get("data_wait_s") is not None]  # fmt: skip
    return summary | {
        "data_wait_s_max": max(waits, default=None),
        "data_wait_s_mean": statistics.fmean(waits),
    }


def throughput(tmp: Path, local: Path, url: str, env: dict[str, str], cache_gib: float, repeats: int,
               only: list[str], progress: Progress) -> dict[str, Any]:  # fmt: skip
    results: dict[str, Any] = {}
    task = progress.add_task("throughput", total=len(only) * repeats * 2)
    for label in only:
        extra, steps, warmup = CONFIGS[label]
        runs: dict[str, list[dict[str, Any]]] = {"local": [], "stream": []}
        for i in range(repeats):
            for side, source in (("local", str(local)), ("stream", url)):
                progress.update(task, description=f"{label} #{i} {side}")
                out, cache = tmp / f"{label}-{side}-{i}", tmp / f"cache-{label}-{i}"
                summary = finish(train(out, source, extra, steps, warmup, env, cache, cache_gib), out)
                runs[side].append({"tokens_per_s": summary["tokens_per_s"], "step_time_s": summary["step_time_s"],
                                   "data_wait_s_mean": summary["data_wait_s_mean"], "data_cache": summary.get("data_cache")})  # fmt: skip
                progress.advance(task)
        med = {side: statistics.median(r["tokens_per_s"] for r in rs) for side, rs in runs.items()}
        results[label] = {
            "runs": runs,
            "tokens_per_s": med,
            "stream_over_local": med["stream"] / med["local"],
        }
        print(f"{label:10s} local {med['local']:10,.0f} tok/s  stream {med['stream']:10,.0f} tok/s  "
              f"ratio {med['stream'] / med['local']:.3f}")  # fmt: skip
    return results


def outage(tmp: Path, url: str, server: S3Server, env: dict[str, str], cache_gib: float, outage_s: float,
           at_step: int, steps: int) -> dict[str, Any]:  # fmt: skip
    from gaudi3_scale.checkpoint.inspect import first_difference
    from gaudi3_scale.checkpoint.reader import read_checkpoint
    from gaudi3_scale.cli.ckpt_cmd import DIFF_KEYS

    summaries, checkpoints = {}, {}
    for name in ("reference", "outage"):
        out = tmp / f"outage-{name}"
        started = time.perf_counter()
        proc = train(out, url, [], steps, 20, env, tmp / f"cache-outage-{name}", cache_gib, checkpoint=True)
        stopped_at = None
        if name == "outage":
            metrics = out / "metrics.jsonl"
            while proc.poll() is None:
                lines = metrics.read_text().splitlines() if metrics.is_file() else []
                if any(json.loads(line).get("step", 0) >= at_step for line in lines):
                    break
                time.sleep(0.2)
            server.stop()
            stopped_at = time.perf_counter() - started
            print(f"object store stopped at {stopped_at:.1f} s for {outage_s:.0f} s")
            time.sleep(outage_s)
            server.start()
        summaries[name] = finish(proc, out) | {
            "wall_s": time.perf_counter() - started,
            "stopped_at_s": stopped_at,
        }
        checkpoints[name] = Path(summaries[name]["checkpoint"])
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
    parser.add_argument("--corpus-mb", type=float, default=16.0, help="generated corpus size")
    parser.add_argument("--shard-mb", type=float, default=0.125, help="data.shard_mb of the prepared corpus")
    parser.add_argument("--cache-mib", type=float, default=1.0, help="data.cache_limit_gib, in MiB")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--only", default="default,gpt2-124m", help="comma-separated: default, gpt2-124m, outage"
    )
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
    cache_gib = args.cache_mib / 1024
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp_name, progress:
        tmp = Path(tmp_name)
        corpus = build_corpus(tmp, args.corpus_mb, file_mb=4.0)
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
        results["dataset"] = {"shards": len(manifest.shards), "bytes": dataset_bytes, "tokens": manifest.num_tokens,
                              "cache_limit_bytes": int(cache_gib * (1 << 30))}  # fmt: skip
        print(
            f"dataset: {len(manifest.shards)} shards, {dataset_bytes / 2**20:.1f} MiB; cache {args.cache_mib} MiB"
        )
        wanted = [c for c in only if c in CONFIGS]
        if wanted:
            results.setdefault("throughput", {}).update(
                throughput(tmp, local, url, env, cache_gib, args.repeats, wanted, progress)
            )
        if "outage" in only:
            results["outage"] = outage(tmp, url, server, env, cache_gib, args.outage_s, args.outage_at_step,
                                       args.outage_steps)  # fmt: skip
    server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    threading.current_thread().name = "bench_stream"
    main()
